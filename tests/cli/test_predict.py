"""`legion-nn predict`: the forward pass over new data, in one process and under `mpiexec`.

The outputs are the model's own, before the loss appended to train it: the logits of a model
that outputs logits, compared with onnxruntime's; every strategy under `mpiexec` writes what one
process writes (float64: the sums differ only in order); a checkpoint's parameters stand in for
the model's; and every bad input is one line, exit 2 and no output file.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli.main import main
from tests.paths import FIXTURES
from tests.runtime.test_distributed import environment

DIGITS = FIXTURES / "digits_cnn.onnx"


def samples(path: Path, count: int = 5, key: str = "x", shape=(1, 8, 8), seed: int = 4) -> Path:
    x = np.random.default_rng(seed).standard_normal((count, *shape)).astype(np.float32)
    np.savez(path, **{key: x})
    return path


def run_cli(*args: str, mpi: int | None = None) -> subprocess.CompletedProcess:
    launcher = ["mpiexec", "-n", str(mpi)] if mpi else []
    return subprocess.run(
        [*launcher, sys.executable, "-m", "cli", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=environment(),
        check=False,
    )


def test_the_logits_of_a_model_that_outputs_logits_are_onnxruntimes(tmp_path):
    import onnxruntime as ort

    data = samples(tmp_path / "x.npz")
    out = tmp_path / "y.npz"
    # a last batch of 2: padded to the batch of 3, its padding dropped
    assert main(["predict", str(DIGITS), "--data", str(data), "--output", str(out),
                 "--batch", "3"]) == 0  # fmt: skip
    x = np.load(data)["x"]
    session = ort.InferenceSession(str(DIGITS), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"x": x})
    with np.load(out) as written:
        assert set(written.files) == {"y", "logits"}  # the model's output by its own name too
        got = written["logits"]
        np.testing.assert_array_equal(written["y"], got)
    assert got.shape == expected.shape == (5, 10)
    # float32 through a few small layers: a few roundings of values of order 10
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.serial
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not installed")
@pytest.mark.parametrize("strategy", ["model", "spatial"])
def test_under_mpiexec_every_strategy_writes_what_one_process_writes(tmp_path, strategy):
    data = samples(tmp_path / "x.npz", count=4)
    one, two = tmp_path / "one.npz", tmp_path / "two.npz"
    common = ["--data", str(data), "--batch", "4", "--dtype", "float64"]
    assert main(["predict", str(DIGITS), *common, "--output", str(one)]) == 0
    result = run_cli("predict", str(DIGITS), *common, "--output", str(two),
                     "--strategy", strategy, mpi=2)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "on 2 ranks" in result.stdout
    with np.load(one) as a, np.load(two) as b:
        scale = np.abs(a["y"]).max()
        np.testing.assert_allclose(b["y"], a["y"], rtol=0, atol=1e-12 * scale)


def test_a_checkpoint_stands_in_for_the_models_parameters(tmp_path):
    from legion_nn.importers.onnx_model import load_onnx
    from runtime import checkpoint
    from runtime.prediction import Predictor
    from runtime.transport import ThreadTransport

    ckpt = tmp_path / "ckpt"
    assert main(["train", str(DIGITS), "--data", "synthetic", "--steps", "2", "--batch", "4",
                 "--checkpoint", str(ckpt), "--no-progress"]) == 0  # fmt: skip
    data = samples(tmp_path / "x.npz", count=3)
    out, own = tmp_path / "trained.npz", tmp_path / "own.npz"
    args = ["--data", str(data), "--batch", "3"]
    assert (
        main(["predict", str(DIGITS), *args, "--output", str(out), "--checkpoint", str(ckpt)]) == 0
    )
    assert main(["predict", str(DIGITS), *args, "--output", str(own)]) == 0
    trained, _ = checkpoint.load(ckpt, {})
    (transport,) = ThreadTransport.group(1)
    network = load_onnx(DIGITS)
    expected = Predictor(network, 3, transport, "data", "float32", trained).outputs(
        np.load(data)["x"]
    )
    with np.load(out) as got, np.load(own) as untrained:
        np.testing.assert_array_equal(got["y"], expected.reshape(3, 10))
        assert np.abs(got["y"] - untrained["y"]).max() > 1e-3  # training moved the outputs


def test_parameters_of_another_shape_are_named():
    """Parameters to start from whose shape the model does not have: one line naming the
    tensor, before anything is drawn or run."""
    from legion_nn.errors import LegionNNError
    from legion_nn.importers.onnx_model import load_onnx
    from runtime.prediction import Predictor
    from runtime.transport import ThreadTransport

    network = load_onnx(DIGITS)
    name, value = next(iter(network.initial.items()))
    wrong = dict(network.initial, **{name: np.zeros((*value.shape, 2), value.dtype)})
    (transport,) = ThreadTransport.group(1)
    with pytest.raises(LegionNNError, match=rf"^checkpoint: tensor {name} \[.*\] does not fit"):
        Predictor(network, 3, transport, "data", "float32", wrong)


GPT = FIXTURES / "tiny_gpt.onnx"


def test_a_gpt_predicts_onnxruntimes_logits_for_every_token(tmp_path):
    """Token ids under the model's own input name; the (N, T, V) logits, not the token-level
    loss appended to train it."""
    import onnxruntime as ort

    ids = np.random.default_rng(5).integers(0, 64, (3, 16)).astype(np.int64)
    data, out = tmp_path / "ids.npz", tmp_path / "logits.npz"
    np.savez(data, ids=ids)
    assert main(["predict", str(GPT), "--data", str(data), "--output", str(out)]) == 0
    session = ort.InferenceSession(str(GPT), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"ids": ids})
    got = np.load(out)["logits"]
    assert got.shape == expected.shape == (3, 16, 64)
    # float32 through two blocks of width 32: roundings of values of order 1
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())


def test_token_ids_outside_the_vocabulary_are_named(tmp_path):
    data = tmp_path / "ids.npz"
    np.savez(data, ids=np.full((2, 16), 64, np.int64))
    line = bad(tmp_path, str(GPT), "--data", str(data))
    assert "ids.npz: ids holds ids outside [0, 64) (the vocabulary)" in line


def bad(tmp_path, *args: str) -> str:
    out = tmp_path / "out.npz"
    result = run_cli("predict", *args, "--output", str(out))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.npz")]
    return lines[0]


def test_samples_of_the_wrong_shape_are_named(tmp_path):
    data = samples(tmp_path / "x.npz", shape=(1, 7, 8))
    line = bad(tmp_path, str(DIGITS), "--data", str(data))
    assert "x.npz: x has shape [5, 1, 7, 8]; the model takes [samples, 1, 8, 8]" in line


def test_samples_under_another_name_are_named(tmp_path):
    data = samples(tmp_path / "x.npz", key="images")
    line = bad(tmp_path, str(DIGITS), "--data", str(data))
    assert "no samples under 'x'" in line and "it holds images" in line


def test_an_output_in_a_missing_directory_is_named_before_anything_runs(tmp_path):
    data = samples(tmp_path / "x.npz")
    out = tmp_path / "missing" / "y.npz"
    result = run_cli("predict", str(DIGITS), "--data", str(data), "--output", str(out))
    assert result.returncode == 2 and "no directory" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_file_that_is_no_npz_is_named(tmp_path):
    data = tmp_path / "x.npz"
    data.write_text("not a zip")
    assert "x.npz: not an .npz file" in bad(tmp_path, str(DIGITS), "--data", str(data))


def test_a_checkpoint_of_another_network_is_named(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert main(["train", "seed-lcn-small", "--data", "synthetic", "--steps", "1", "--batch", "2",
                 "--checkpoint", str(ckpt), "--no-progress"]) == 0  # fmt: skip
    data = samples(tmp_path / "x.npz")
    line = bad(tmp_path, str(DIGITS), "--data", str(data), "--checkpoint", str(ckpt))
    assert "checkpoint is for network='seed-lcn-small'" in line


def test_a_model_with_an_op_outside_the_list_is_named(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Cos", ["c"], ["y"])],
        "cosine",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2, 8, 8])],
        [helper.make_tensor("w", TensorProto.FLOAT, [2, 1, 1, 1], [1.0, 2.0])],
    )
    model = tmp_path / "cosine.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(model))
    data = samples(tmp_path / "x.npz")
    line = bad(tmp_path, str(model), "--data", str(data))
    assert "cosine.onnx: node 'y' (Cos): op not supported" in line
