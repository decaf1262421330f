"""A GPT exported by PyTorch (`tests/fixtures/tiny_gpt.onnx`, made by `bench/export_tiny_gpt.py`)
read into a network: against onnxruntime, against PyTorch's own training step, split over ranks,
and written back.

onnxruntime and the fixture's parameters are float32; legion-nn runs float64 from the same values,
so the differences are onnxruntime's rounding through two blocks (about 1e-7 in probability).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from legion_nn.importers.onnx_export import save_onnx
from legion_nn.importers.onnx_model import load_onnx
from runtime.adapters import StepContext
from runtime.dataset import Dataset, Split
from runtime.rank_executor import one_process
from runtime.training import TrainConfig, Trainer
from tests.paths import FIXTURES, ROOT
from tests.runtime.test_rank_executor import assert_same, local_run, ranks_run

GPT = FIXTURES / "tiny_gpt.onnx"
RNG = np.random.default_rng(31)


def token_ids(rows: int, network) -> np.ndarray:
    return RNG.integers(0, network.vocab, (rows, network.input[0])).astype(np.int32)


def probabilities(network, x: np.ndarray, initial=None) -> np.ndarray:
    """legion-nn's probabilities for `x` (token ids or images) in inference, in float64, from
    `initial` (the model's own parameters by default)."""
    graph = network.lower(batch=len(x), dtype="float64")
    executor = one_process(0)
    executor.prepare(graph)
    executor.load_resident(initial if initial is not None else network.initial)
    labels = np.zeros(network.label_dims(len(x)), np.int32)
    executor.run_inference(graph, StepContext(0, training=False, inputs=x, labels=labels))
    return executor.value(next(t for t in graph.tensors if t.endswith(".probability")))


def onnxruntime_probabilities(path: Path, ids: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"ids": ids.astype(np.int64)})
    shifted = np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


def test_the_export_reads_as_the_transformer_it_is():
    network = load_onnx(GPT)
    kinds = [layer.KIND for layer in network.layers]
    assert network.input == (16,) and network.vocab == 64 and network.classes == 64
    assert kinds[:2] == ["embedding", "position"]
    for kind, count in [("split_heads", 6), ("matmul", 4), ("row_softmax", 2), ("gelu", 2)]:
        assert kinds.count(kind) == count, kind
    assert all(layer.causal for layer in network.layers if layer.KIND == "row_softmax")
    scores = [layer for layer in network.layers if layer.KIND == "matmul"][::2]
    assert all(layer.transpose_b and layer.scale == pytest.approx(8**-0.5) for layer in scores)
    stored = {t.name for t in onnx.load(str(GPT)).graph.initializer}
    assert {"tok.weight", "pos.weight", "ln_f.weight", "head.bias"} <= set(network.initial)
    assert "blocks.0.attn.mask" in stored and "blocks.0.attn.mask" not in network.initial


def test_the_forward_pass_matches_onnxruntime():
    network = load_onnx(GPT)
    ids = token_ids(3, network)
    got, expected = probabilities(network, ids), onnxruntime_probabilities(GPT, ids)
    assert got.shape == (3, 16, 64)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.log(got), np.log(expected), rtol=0, atol=1e-4)


def language_model(network, rows: int = 6, lr: float = 0.1) -> TrainConfig:
    ids = token_ids(rows + 1, network)
    x, y = ids[:rows], np.roll(ids[:rows], -1, axis=1)
    empty = Split(ids[:0], ids[:0])
    return TrainConfig(
        network=network,
        dataset=Dataset("ids", Split(x, y), empty, empty),
        batch=3,
        dtype="float64",
        seed=1,
        optimizer="sgd",
        hyperparameters={"lr": lr},
        shuffle=False,
    )


def test_one_sgd_step_equals_pytorchs(tmp_path):
    """The model exported afresh from PyTorch, and one float64 SGD step taken by both."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "bench"))
    from export_tiny_gpt import main, module

    path = tmp_path / "gpt.onnx"
    assert main(["--out", str(path)]) == 0
    network = load_onnx(path)
    cfg = language_model(network, rows=3, lr=0.5)
    trainer = Trainer(cfg)
    trainer.executor.prepare(trainer.graph(3))
    trainer.executor.load_resident(network.initial)
    ours = {k: v.copy() for k, v in trainer.executor.resident().items()}
    loss, _ = trainer.step(0)
    stepped = trainer.executor.resident()

    model = module().double()
    params = dict(model.named_parameters())
    names = {name: params[name] for name in ours if name in params}  # our name: PyTorch's
    for name, start in ours.items():  # the exporter's MatMul weights: Linear weights transposed
        if name not in params:
            (found,) = [p for p in params.values() if np.array_equal(start.T, p.detach().numpy())]
            names[name] = found.T
    assert len(names) == len(ours) == len(params)
    x = torch.from_numpy(cfg.dataset.train.x[:3].astype(np.int64))
    y = torch.from_numpy(cfg.dataset.train.y[:3].astype(np.int64))
    logits = model(x)
    reference = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), y.reshape(-1))
    reference.backward()
    with torch.no_grad():
        for param in model.parameters():
            param -= 0.5 * param.grad
    assert loss == pytest.approx(reference.item(), rel=1e-7)
    for name, param in names.items():
        np.testing.assert_allclose(stepped[name], param.detach().numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("strategy", "nranks"), [("data", 2), ("model", 2), ("spatial", 2)])
def test_the_export_split_over_ranks_equals_one_process(strategy, nranks):
    cfg = language_model(load_onnx(GPT))
    assert_same(local_run(cfg, steps=2), ranks_run(cfg, nranks, strategy, steps=2))


def test_save_onnx_writes_the_trained_model_onnxruntime_predicts_alike(tmp_path):
    network = load_onnx(GPT)
    trainer = Trainer(language_model(network, lr=0.5))
    trainer.executor.prepare(trainer.graph(3))
    trainer.executor.load_resident(network.initial)
    for step in range(2):
        trainer.step(step)
    trained = trainer.executor.resident()
    out = tmp_path / "trained.onnx"
    save_onnx(GPT, trained, out)
    ids = token_ids(2, network)
    ours = probabilities(load_onnx(out), ids)
    np.testing.assert_allclose(ours, probabilities(network, ids, trained), rtol=0, atol=1e-6)
    np.testing.assert_allclose(onnxruntime_probabilities(out, ids), ours, rtol=0, atol=1e-4)
    assert not np.allclose(ours, probabilities(network, ids), atol=1e-3)  # it did train


def refused(tmp_path: Path, edit) -> str:
    model = onnx.load(str(GPT))
    edit(model)
    path = tmp_path / "bad.onnx"
    onnx.save(model, str(path))
    result = subprocess.run(
        [sys.executable, "-m", "cli", "graph", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    return lines[0]


def test_bad_models_get_one_line(tmp_path):
    def dynamic_length(model):
        model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "sequence"

    def unknown_op(model):
        gelu = next(n for n in model.graph.node if n.op_type == "Erf")
        gelu.op_type = "Sinh"

    assert "legion-nn needs [batch, T] with the sequence length T known" in refused(
        tmp_path, dynamic_length
    )
    line = refused(tmp_path, unknown_op)  # GELU's region now ends at the Sinh: its first node
    assert "mlp/mlp.1/Div" in line and "op not supported; supported: Conv" in line


VIT = FIXTURES / "tiny_vit.onnx"


def images_config(network, rows: int = 6) -> TrainConfig:
    x = RNG.standard_normal((rows, *network.input))
    y = RNG.integers(0, network.classes, rows).astype(np.int32)
    empty = Split(x[:0], y[:0])
    return TrainConfig(
        network=network,
        dataset=Dataset("images", Split(x, y), empty, empty),
        batch=3,
        dtype="float64",
        seed=1,
        optimizer="sgd",
        shuffle=False,
    )


def test_a_vision_transformer_matches_onnxruntime():
    """Patches by a strided Conv, tokens, a class token, positions, blocks, the class token's
    head (`tests/fixtures/tiny_vit.onnx`, made by `bench/export_tiny_vit.py`)."""
    network = load_onnx(VIT)
    kinds = [layer.KIND for layer in network.layers]
    assert kinds[:4] == ["conv", "image_tokens", "class_token", "position"]
    assert kinds[-4:] == ["select_token", "linear", "softmax", "evaluate"]
    assert not any(layer.causal for layer in network.layers if layer.KIND == "row_softmax")
    x = RNG.standard_normal((3, *network.input)).astype(np.float32)
    got = probabilities(network, x.astype(np.float64))
    session = ort.InferenceSession(str(VIT), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"images": x})
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(got.reshape(3, -1), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("strategy", "nranks"), [("model", 2), ("spatial", 3)])
def test_a_vision_transformer_split_over_ranks_equals_one_process(strategy, nranks):
    """3 ranks cut the 16 patch tokens 6, 5, 5: inside a row of 4."""
    cfg = images_config(load_onnx(VIT))
    assert_same(local_run(cfg, steps=2), ranks_run(cfg, nranks, strategy, steps=2))


def test_a_position_table_longer_than_the_sequence_reads_its_first_rows(tmp_path):
    """A model made for a longer context (nanoGPT's block_size > T): the exported table has
    more rows than the sequence has tokens; the first T are read, the rest kept and saved."""
    model = onnx.load(str(GPT))
    (table,) = [t for t in model.graph.initializer if t.name == "pos.weight"]
    value = onnx.numpy_helper.to_array(table)
    longer = np.concatenate([value, RNG.standard_normal((8, value.shape[1])).astype(value.dtype)])
    table.CopyFrom(onnx.numpy_helper.from_array(longer, "pos.weight"))
    path = tmp_path / "longer.onnx"
    onnx.save(model, str(path))
    network = load_onnx(path)
    position = next(layer for layer in network.layers if layer.KIND == "position")
    assert position.rows == 24 and network.initial["pos.weight"].shape == (24, 32)
    ids = token_ids(2, network)
    np.testing.assert_allclose(
        probabilities(network, ids), onnxruntime_probabilities(path, ids), rtol=0, atol=1e-4
    )
    out = tmp_path / "saved.onnx"
    save_onnx(path, network.initial, out)
    saved = {t.name: t for t in onnx.load(str(out)).graph.initializer}
    assert np.array_equal(onnx.numpy_helper.to_array(saved["pos.weight"]), longer)
