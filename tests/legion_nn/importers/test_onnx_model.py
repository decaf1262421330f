"""ONNX models read into networks (`legion_nn.importers.onnx_model`), checked against onnxruntime.

Each model is built with `onnx.helper` in float32 (onnxruntime's CPU Conv has no float64), and
its forward pass compared with onnxruntime's in inference mode. legion-nn runs it in float64 from
the same float32 parameters, so the difference is onnxruntime's rounding: every output is a sum
of at most 54 products per layer, two layers deep, of terms below about 10 in magnitude (weights
of scale 0.5 on unit inputs), so each logit is within γ(54)·10 per layer, about 2·54·2⁻²⁴·10 ≈
7e-5, of the exact value, and a probability moves by at most half as much as the logits do:
`BOUND` = 1e-4. A wrong weight layout, padding or bias moves them by 1e-2 or more.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network as load
from runtime.adapters import StepContext
from runtime.rank_executor import one_process
from runtime.training import TrainConfig, Trainer
from tests.paths import FIXTURES, ROOT

RNG = np.random.default_rng(7)
BOUND = 1e-4


def constant(name: str, shape, scale: float = 0.5) -> onnx.TensorProto:
    return numpy_helper.from_array((RNG.standard_normal(shape) * scale).astype(np.float32), name)


def model(path: Path, nodes, inputs, output, initializers, rank: int = 2) -> Path:
    """A float32 model of `nodes` from input `x` (shape `inputs`) to `output` (of `rank` dims)."""
    graph = helper.make_graph(
        nodes,
        path.stem,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, inputs)],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, [None] * rank)],
        initializers,
    )
    made = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(made)
    onnx.save(made, path)
    return path


def conv_gemm(tmp: Path) -> Path:
    """Conv (bias, pads, stride 2) → Relu → Flatten → Gemm (transB): logits."""
    nodes = [
        helper.make_node("Conv", ["x", "c.w", "c.b"], ["c"], name="conv", pads=[1, 0, 2, 1],
                         strides=[2, 2]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["y"], name="fc", transB=1),
    ]  # fmt: skip
    # 7×7 input, pads top 1 bottom 2 left 0 right 1, kernel 3, stride 2: 4×3 outputs
    weights = [constant("c.w", (4, 2, 3, 3)), constant("c.b", (4,)), constant("fc.w", (5, 48)),
               constant("fc.b", (5,))]  # fmt: skip
    return model(tmp / "conv_gemm.onnx", nodes, ["N", 2, 7, 7], "y", weights)


def pool_matmul(tmp: Path) -> Path:
    """Conv (no bias) → Tanh → MaxPool (padded) → Reshape [0, -1] → MatMul + Add → Softmax."""
    nodes = [
        helper.make_node("Conv", ["x", "c.w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Tanh", ["c"], ["t"], name="tanh"),
        helper.make_node("MaxPool", ["t"], ["p"], name="pool", kernel_shape=[2, 2],
                         strides=[2, 2], pads=[0, 0, 1, 1]),
        helper.make_node("Reshape", ["p", "shape"], ["s"], name="reshape"),
        helper.make_node("MatMul", ["s", "mm.w"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "mm.b"], ["a"], name="bias"),
        helper.make_node("Softmax", ["a"], ["y"], name="softmax", axis=1),
    ]  # fmt: skip
    shape = numpy_helper.from_array(np.array([0, -1], np.int64), "shape")
    # 5×5 → conv pad 1 → 5×5 → pool 2, pad bottom/right 1 → 3×3; 3 channels: 27 features
    weights = [constant("c.w", (3, 1, 3, 3)), shape, constant("mm.w", (27, 4)),
               constant("mm.b", (4,))]  # fmt: skip
    return model(tmp / "pool_matmul.onnx", nodes, ["N", 1, 5, 5], "y", weights)


def features(tmp: Path) -> Path:
    """A flat input: Gemm (transB 0) → Sigmoid → Dropout → Identity → Gemm → LogSoftmax."""
    nodes = [
        helper.make_node("Gemm", ["x", "a.w", "a.b"], ["a"], name="a"),
        helper.make_node("Sigmoid", ["a"], ["s"], name="sigmoid"),
        helper.make_node("Dropout", ["s", "ratio"], ["d"], name="dropout"),
        helper.make_node("Identity", ["d"], ["i"], name="identity"),
        helper.make_node("Gemm", ["i", "b.w"], ["b"], name="b", transB=1),
        helper.make_node("LogSoftmax", ["b"], ["y"], name="logsoftmax", axis=1),
    ]
    ratio = numpy_helper.from_array(np.array(0.25, np.float32), "ratio")
    weights = [constant("a.w", (6, 8)), constant("a.b", (8,)), ratio, constant("b.w", (3, 8))]
    return model(tmp / "features.onnx", nodes, ["batch", 6], "y", weights)


def batchnorm(tmp: Path) -> Path:
    """Conv → BatchNormalization (running statistics) → Relu → Flatten → Gemm."""
    nodes = [
        helper.make_node("Conv", ["x", "c.w", "c.b"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "bn.scale", "bn.bias", "bn.mean", "bn.var"],
                         ["n"], name="bn", epsilon=1e-3),
        helper.make_node("Relu", ["n"], ["r"], name="relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.w"], ["y"], name="fc", transB=1),
    ]  # fmt: skip
    var = numpy_helper.from_array(RNG.uniform(0.5, 2.0, 3).astype(np.float32), "bn.var")
    weights = [constant("c.w", (3, 2, 2, 2)), constant("c.b", (3,)), constant("bn.scale", (3,)),
               constant("bn.bias", (3,)), constant("bn.mean", (3,)), var,
               constant("fc.w", (4, 27))]  # fmt: skip
    return model(tmp / "batchnorm.onnx", nodes, [2, 2, 4, 4], "y", weights)


def pooled(tmp: Path) -> Path:
    """Conv → AveragePool (padded, padding not counted) → Relu → GlobalAveragePool → Flatten
    → Gemm."""
    nodes = [
        helper.make_node("Conv", ["x", "c.w", "c.b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("AveragePool", ["c"], ["a"], name="avg", kernel_shape=[3, 3],
                         strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["y"], name="fc", transB=1),
    ]  # fmt: skip
    weights = [constant("c.w", (4, 3, 3, 3)), constant("c.b", (4,)), constant("fc.w", (5, 4)),
               constant("fc.b", (5,))]  # fmt: skip
    return model(tmp / "pooled.onnx", nodes, ["N", 3, 8, 7], "y", weights)


def residual(tmp: Path) -> Path:
    """A residual block and a side branch, merged by Sum and Concat: Conv → Tanh (the block's
    input) → Conv → Tanh → Conv → Sum (with the block's input and the middle Conv) → Sigmoid; a 1x1 Conv of the
    block's input beside it; Concat of the two on channels → GlobalAveragePool → Flatten →
    Gemm."""
    nodes = [
        helper.make_node("Conv", ["x", "c0.w", "c0.b"], ["c0"], name="c0", pads=[1, 1, 1, 1]),
        helper.make_node("Tanh", ["c0"], ["t0"], name="t0"),
        helper.make_node("Conv", ["t0", "c1.w"], ["c1"], name="c1", pads=[1, 1, 1, 1]),
        helper.make_node("Tanh", ["c1"], ["t1"], name="t1"),
        helper.make_node("Conv", ["t1", "c2.w", "c2.b"], ["c2"], name="c2", pads=[1, 1, 1, 1]),
        helper.make_node("Sum", ["c2", "t0", "c1"], ["sum"], name="res"),
        helper.make_node("Sigmoid", ["sum"], ["s"], name="s"),
        helper.make_node("Conv", ["t0", "side.w"], ["side"], name="side"),
        helper.make_node("Concat", ["s", "side"], ["cat"], name="cat", axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["y"], name="fc", transB=1),
    ]  # fmt: skip
    weights = [constant("c0.w", (4, 2, 3, 3)), constant("c0.b", (4,)),
               constant("c1.w", (4, 4, 3, 3)), constant("c2.w", (4, 4, 3, 3)),
               constant("c2.b", (4,)), constant("side.w", (3, 4, 1, 1)),
               constant("fc.w", (5, 7)), constant("fc.b", (5,))]  # fmt: skip
    return model(tmp / "residual.onnx", nodes, ["N", 2, 6, 5], "y", weights)


MODELS = {"conv_gemm": conv_gemm, "pool_matmul": pool_matmul, "features": features,
          "batchnorm": batchnorm, "pooled": pooled, "residual": residual}  # fmt: skip


def probabilities(network, x: np.ndarray) -> np.ndarray:
    """legion-nn's class probabilities for `x`, from the model's parameters, in inference."""
    graph = network.lower(batch=len(x), dtype="float64")
    executor = one_process(0)
    executor.prepare(graph)
    executor.load_resident(network.initial)
    labels = np.zeros(len(x), np.int32)
    executor.run_inference(graph, StepContext(0, training=False, inputs=x, labels=labels))
    name = next(t for t in graph.tensors if t.endswith(".probability"))
    return executor.value(name).reshape(len(x), -1)


def reference(path: Path, x: np.ndarray) -> np.ndarray:
    """onnxruntime's output as probabilities (softmax of logits, exp of log-probabilities)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    shape = (len(x), *session.get_inputs()[0].shape[1:])
    (out,) = session.run(None, {"x": x.reshape(shape).astype(np.float32)})
    out = out.astype(np.float64)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    if ops[-1] == "Softmax":
        return out
    if ops[-1] == "LogSoftmax":
        return np.exp(out)
    shifted = np.exp(out - out.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_the_forward_pass_matches_onnxruntime(make, tmp_path):
    path = make(tmp_path)
    network = load(str(path))
    x = RNG.standard_normal((2, *network.input)).astype(np.float32).astype(np.float64)
    got = probabilities(network, x)
    np.testing.assert_allclose(got, reference(path, x), rtol=0, atol=BOUND)


def test_parameters_keep_their_initializer_names_and_values(tmp_path):
    path = conv_gemm(tmp_path)
    network = load(str(path))
    graph = network.lower(batch=3)
    params = {n for n, t in graph.tensors.items() if t.kind == "param"}
    assert params == {"c.w", "c.b", "fc.w", "fc.b"}
    stored = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    np.testing.assert_array_equal(network.initial["c.w"].reshape(4, 2, 3, 3), stored["c.w"])
    np.testing.assert_array_equal(network.initial["fc.w"].reshape(5, 48), stored["fc.w"])
    # the batch dim is the lowering's, whatever the model declares
    assert graph.tensors["data.raw_output"].dims == (3, 2, 7, 7)


def test_training_starts_from_the_initializers(tmp_path):
    from runtime import data

    network = load(str(batchnorm(tmp_path)))
    dataset = data.synthetic(network.input, network.classes, seed=1, samples=20, dtype=np.float64)
    config = TrainConfig(network=network, dataset=dataset, batch=2, steps=1, dtype="float64",
                         optimizer="sgd", hyperparameters={"lr": 0.0})  # fmt: skip
    trainer = Trainer(config)
    trainer.run()
    resident = trainer.executor.resident()
    for name, value in network.initial.items():
        if name.endswith(".running"):
            continue  # a training step moves the running statistics
        np.testing.assert_array_equal(resident[name], value, err_msg=name)


def bad(tmp: Path, name: str, nodes, inputs, initializers) -> Path:
    return model(
        tmp / f"{name}.onnx", nodes, inputs, nodes[-1].output[0], initializers, len(inputs)
    )


def refused(tmp: Path) -> dict[str, tuple[Path, str]]:
    grouped = bad(tmp, "grouped", [helper.make_node("Conv", ["x", "w"], ["y"], name="g", group=3)],
                  ["N", 2, 4, 4], [constant("w", (3, 1, 3, 3))])  # fmt: skip
    dilated = bad(tmp, "dilated", [helper.make_node("Conv", ["x", "w"], ["y"], name="d",
                                                    dilations=[2, 2])],
                  ["N", 1, 6, 6], [constant("w", (1, 1, 3, 3))])  # fmt: skip
    elu = bad(tmp, "elu", [helper.make_node("Elu", ["x"], ["y"], name="e")], ["N", 3], [])
    unknown = bad(tmp, "unknown", [helper.make_node("Relu", ["x"], ["y"], name="r")],
                  ["N", "C", 4, 4], [])  # fmt: skip
    broadcast = bad(tmp, "broadcast", [helper.make_node("Relu", ["x"], ["r"], name="r"),
                                       helper.make_node("Conv", ["x", "w1"], ["c"], name="c"),
                                       helper.make_node("Add", ["r", "c"], ["y"], name="a")],
                    ["N", 3, 4, 4], [constant("w1", (1, 3, 1, 1))])  # fmt: skip
    garbage = tmp / "garbage.onnx"
    garbage.write_text("this is not a model\n")
    truncated = tmp / "truncated.onnx"
    truncated.write_bytes(conv_gemm(tmp).read_bytes()[:200])
    return {
        "grouped Conv": (
            grouped,
            "node 'g' (Conv): layer g (conv): groups 3 must divide its 2 input channels",
        ),
        "dilated Conv": (dilated, "node 'd' (Conv): dilated Conv is not supported"),
        "unsupported op": (elu, "node 'e' (Elu): op not supported; supported: Conv, LRN"),
        "unknown shape": (unknown, "input 'x' has shape ['N', 'C', 4, 4]"),
        "broadcast Add": (
            broadcast,
            "node 'a' (Add): adds shapes [[3, 4, 4], [1, 4, 4]]; broadcasting is not supported",
        ),
        "not ONNX": (garbage, "garbage.onnx: not an ONNX model"),
        "truncated": (truncated, "truncated.onnx: not an ONNX model"),
    }


@pytest.mark.parametrize(
    "case", ["grouped Conv", "dilated Conv", "unsupported op", "unknown shape", "not ONNX",
             "truncated", "broadcast Add"]
)  # fmt: skip
def test_bad_models_get_one_line_and_nothing_is_written(case, tmp_path):
    path, message = refused(tmp_path)[case]
    with pytest.raises(LegionNNError, match=re.escape(message)):
        load(str(path))
    out = tmp_path / "plan.json"
    result = subprocess.run(
        [sys.executable, "-m", "cli", "partition", str(path), "--ranks", "2",
         "--strategy", "data", "--json", str(out)],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not out.exists()


def test_every_command_takes_a_model(tmp_path):
    """graph, partition, memory, render and train each read an ONNX model as a network: the
    graph is the network's lowering, the plan covers every layer on the ranks asked, the peak
    holds at least the parameters, the drawing has every task, and training runs its steps."""
    path = str(pool_matmul(tmp_path))
    network = load(path)

    def cli(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "cli", *args],
            capture_output=True, text=True, check=False, cwd=ROOT,
        )  # fmt: skip
        assert result.returncode == 0, (args[0], result.stderr)
        return result.stdout

    cli("graph", path, "--batch", "4", "--json", str(tmp_path / "g.json"))
    written = json.loads((tmp_path / "g.json").read_text())
    assert [t["name"] for t in written["tasks"]] == [t.name for t in network.lower(4).tasks]

    report = cli("partition", path, "--ranks", "3", "--strategy", "auto", "--batch", "6")
    assert report.startswith("pool_matmul, batch 6: auto on 3 ranks")
    rows = {line.split()[0] for line in report.splitlines() if line.strip()}
    # the loss's rows are its tasks' (softmax, evaluate)
    loss = ("softmax", "evaluate")
    assert {layer.name for layer in network.layers if layer.KIND not in loss} <= rows
    assert re.search(r"^step [0-9.]+ s, simulated", report, re.MULTILINE)

    memory = cli("memory", path, "--batch", "4")
    peak = int(re.search(r"peak\s+([0-9,]+) bytes", memory).group(1).replace(",", ""))
    params = int(re.search(r"parameters\s+([0-9,]+) bytes", memory).group(1).replace(",", ""))
    assert peak >= params == 4 * sum(v.size for v in network.initial.values())

    cli("render", path, "-o", str(tmp_path / "m.dot"), "--batch", "2")
    drawing = (tmp_path / "m.dot").read_text()
    assert drawing.startswith("digraph pool_matmul")
    assert f"{len(network.lower(2).tasks)} tasks" in drawing

    trained = cli("train", path, "--data", "synthetic", "--steps", "2", "--batch", "4",
                  "--no-progress")  # fmt: skip
    assert "batch 4, 2 steps" in trained
    assert re.search(r"^done in [0-9.]+ s: test accuracy [0-9.]+", trained, re.MULTILINE)


@pytest.mark.parametrize(
    "make", [features, pool_matmul, batchnorm], ids=["features", "pool_matmul", "batchnorm"]
)
def test_save_onnx_writes_the_trained_parameters_back(make, tmp_path):
    from runtime import data

    path = make(tmp_path)
    network = load(str(path))
    dataset = data.synthetic(network.input, network.classes, seed=2, samples=24)
    out = tmp_path / "trained.onnx"
    config = TrainConfig(network=network, dataset=dataset, batch=4, steps=3, save_onnx=str(out))
    trainer = Trainer(config)
    trainer.run()
    trained = trainer.executor.resident()
    again = load(str(out))  # onnx.checker passed on the way out, and in again
    assert set(again.initial) == set(network.initial)
    for name, value in again.initial.items():
        # parameters train in float32 as they are stored; running statistics are float64 here
        np.testing.assert_allclose(value, trained[name], rtol=1e-6, atol=0, err_msg=name)
        assert not np.array_equal(value, network.initial[name]), name  # training moved it
    x = RNG.standard_normal((2, *network.input)).astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(probabilities(again, x), reference(out, x), rtol=0, atol=BOUND)


def test_save_onnx_needs_a_model(tmp_path):
    out = tmp_path / "x.onnx"
    result = subprocess.run(
        [sys.executable, "-m", "cli", "train", "seed-lcn-small", "--steps", "1",
         "--no-progress", "--save-onnx", str(out)],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--save-onnx needs an ONNX model to train" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()


def test_a_pytorch_export_trains_on_digits_and_saves_what_onnxruntime_predicts_alike(tmp_path):
    """`tests/fixtures/digits_cnn.onnx`, made by `bench/export_digits_cnn.py` (PyTorch's exporter,
    its default initialisation): trained here from those parameters it reaches 95% on digits'
    test split, and its `--save-onnx` output predicts in onnxruntime what legion-nn predicts.

    onnxruntime runs the saved model in float32 and legion-nn in float64: four layers of sums of
    at most 144 float32 products, terms of O(10) after training, each within γ(144)·10·|w| ≈ 1e-4
    of exact, so probabilities within 1e-3, and a prediction can differ only where the top two
    probabilities are closer than twice that."""
    from runtime import data

    model = FIXTURES / "digits_cnn.onnx"
    out, log = tmp_path / "trained.onnx", tmp_path / "log.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "cli", "train", str(model), "--data", "digits",
         "--epochs", "20", "--no-progress", "--save-onnx", str(out), "--log-json", str(log)],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    done = [r for r in map(json.loads, log.read_text().splitlines()) if r.get("event") == "done"]
    assert done[0]["test_accuracy"] >= 0.95
    trained = load(str(out))
    test = data.digits(trained.input, trained.classes).test
    ours = probabilities(trained, test.x.astype(np.float64))
    theirs = reference(out, test.x)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3)
    top2 = np.sort(ours, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2e-3
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(ours[clear].argmax(axis=1), theirs[clear].argmax(axis=1))


def test_parameters_an_exporter_merged_train_apart_and_are_saved_apart(tmp_path):
    """PyTorch's exporter writes one initializer for parameters that start equal (zero biases)
    and an Identity per use; each use is a parameter of its own, and is saved as one."""
    zero = numpy_helper.from_array(np.zeros(3, np.float32), "zeros")
    nodes = [
        helper.make_node("Identity", ["zeros"], ["b1"], name="share1"),
        helper.make_node("Identity", ["zeros"], ["b2"], name="share2"),
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2"),
        helper.make_node("Flatten", ["c2"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.w"], ["y"], name="fc", transB=1),
    ]
    weights = [zero, constant("w1", (3, 1, 3, 3)), constant("w2", (3, 3, 3, 3)),
               constant("fc.w", (4, 12))]  # fmt: skip
    path = model(tmp_path / "shared.onnx", nodes, ["N", 1, 4, 4], "y", weights)
    network = load(str(path))
    graph = network.lower(batch=2)
    assert {"b1", "b2"} <= {n for n, t in graph.tensors.items() if t.kind == "param"}
    np.testing.assert_array_equal(network.initial["b1"], np.zeros((1, 3, 1, 1)))
    x = RNG.standard_normal((2, *network.input)).astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(probabilities(network, x), reference(path, x), rtol=0, atol=BOUND)
    from runtime import data

    out = tmp_path / "trained.onnx"
    dataset = data.synthetic(network.input, network.classes, seed=3, samples=16)
    trainer = Trainer(TrainConfig(network=network, dataset=dataset, batch=4, steps=3,
                                  save_onnx=str(out)))  # fmt: skip
    trainer.run()
    saved = onnx.load(str(out))
    stored = {t.name: numpy_helper.to_array(t) for t in saved.graph.initializer}
    assert "b1" in stored and "b2" in stored and not np.array_equal(stored["b1"], stored["b2"])
    assert "Identity" not in [n.op_type for n in saved.graph.node]
    np.testing.assert_allclose(probabilities(load(str(out)), x), reference(out, x), atol=BOUND)


def test_a_residual_models_gradients_match_finite_differences(tmp_path):
    """Through the executor in float64: the add's gradient reaches both its inputs, the concat's
    each of its own, and the block's input gets the sum of the three readers' gradients."""
    from tests.runtime.test_executor import whole_network_gradient_check

    network = load(str(residual(tmp_path)))
    kinds = [layer.KIND for layer in network.layers]
    assert "add" in kinds and "concat" in kinds
    worst = whole_network_gradient_check(network, batch=3, samples=6)
    assert set(worst) == {"c0.w", "c0.b", "c1.w", "c2.w", "c2.b", "side.w", "fc.w", "fc.b"}
    for param, error in worst.items():
        assert error < 1e-5, (param, error)
