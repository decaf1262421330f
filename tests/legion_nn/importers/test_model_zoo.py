"""ONNX's own model-zoo test set (`onnx/backend/test/data/light/`, shipped with the `onnx`
package): all nine models import, and `predict` gives the set's reference outputs.

Their weights are ConstantOfShape nodes, folded at import (`onnx_fold`); their input is
`arange(n).reshape(shape) / n` in float32, and `light_<name>_output_0.pb` the expected output,
within onnxruntime's tolerance for the set (rtol 1e-3, atol 1e-5). Since the set's weights are
one constant per tensor, its outputs are nearly uniform; the same graphs with seeded random
weights are compared with onnxruntime too, for the models with the ops the set brought (LRN,
grouped and depthwise convolution, the channel shuffle, per-channel scale and shift), in one
process and under `mpiexec` with the model and spatial splits. `bench/model_zoo.py` runs every
model under every split, plans each on 8 and 64 ranks, and times ResNet-50 against onnxruntime.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from bench.model_zoo import ATOL, MODELS, RTOL, light, reference
from legion_nn.importers.onnx_fold import fold
from legion_nn.importers.onnx_model import load_onnx
from runtime.prediction import Predictor
from runtime.transport import ThreadTransport
from tests.runtime.test_distributed import environment

LIGHT = light()


def predict(network, x: np.ndarray) -> np.ndarray:
    """`predict`'s outputs in one process, float32."""
    (transport,) = ThreadTransport.group(1)
    return Predictor(network, len(x), transport, "data", "float32").outputs(x)


@pytest.mark.parametrize("name", MODELS)
def test_a_model_of_the_set_predicts_its_reference_output(name):
    x, expected = reference(name)
    got = predict(load_onnx(LIGHT / f"light_{name}.onnx"), x)
    np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=RTOL, atol=ATOL)


def randomised(model_name: str, tmp_path: Path) -> Path:
    """Model `model_name` with seeded random weights in place of its ConstantOfShape nodes (and
    its initializers), written to `tmp_path`."""
    network = load_onnx(LIGHT / f"light_{model_name}.onnx")
    model = onnx.load(str(LIGHT / f"light_{model_name}.onnx"))
    # the weights in ONNX's shapes (the layers' are reshapes of them): ConstantOfShape nodes,
    # and initializers (opset 9 lists them among the graph's inputs too)
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    shapes = {name: value.shape for name, value in {**fold(model, 1).constants, **stored}.items()}
    rng = np.random.default_rng(7)
    weights = {
        name: (rng.standard_normal(shapes[name]) * 0.1).astype(np.float32)
        for name in network.initial
        if name in shapes  # not batch normalisation's running statistics: the model's own
    }
    kept = [n for n in model.graph.node if not set(n.output) & set(weights)]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    initializers = [t for t in model.graph.initializer if t.name not in weights]
    del model.graph.initializer[:]
    model.graph.initializer.extend(initializers)
    listed = {value.name for value in model.graph.input}
    for name, value in weights.items():
        model.graph.initializer.append(numpy_helper.from_array(value, name))
        if name not in listed:  # IR 3 (opset 9) lists every initializer among the inputs
            model.graph.input.append(
                onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, value.shape)
            )
    path = tmp_path / f"random_{model_name}.onnx"
    onnx.save(model, str(path))
    return path


def onnxruntime_outputs(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # not a warning per ConstantOfShape left without readers
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {session.get_inputs()[0].name: x})
    return expected


def inputs(network, count: int = 1) -> np.ndarray:
    return np.random.default_rng(8).standard_normal((count, *network.input)).astype(np.float32)


@pytest.mark.parametrize("name", ["squeezenet", "bvlc_alexnet", "densenet121", "shufflenet"])
def test_with_random_weights_it_predicts_what_onnxruntime_predicts(name, tmp_path):
    """The set's weights are constant per tensor, so its reference output is uniform (0.001 for
    every class) and says little about the graph; with the same nodes and seeded random weights
    in place of the ConstantOfShape nodes, legion-nn predicts what onnxruntime predicts."""
    path = randomised(name, tmp_path)
    network = load_onnx(path)
    x = inputs(network)
    expected = onnxruntime_outputs(path, x)
    got = predict(network, x).reshape(expected.shape)
    assert expected.std() > 1e-4  # no longer uniform
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.serial
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not installed")
@pytest.mark.parametrize(
    ("name", "strategy"), [("shufflenet", "model"), ("inception_v1", "spatial")]
)
def test_under_mpiexec_a_split_model_predicts_what_onnxruntime_predicts(name, strategy, tmp_path):
    """ShuffleNet cut by channels (its grouped convolutions by groups, its shuffles gathering
    across ranks) and Inception v1 by rows (halos through its branches' windows, LRN, pools)."""
    path = randomised(name, tmp_path)
    network = load_onnx(path)
    x = inputs(network)
    data, out = tmp_path / "x.npz", tmp_path / "y.npz"
    np.savez(data, x=x)
    command = ["mpiexec", "-n", "2", sys.executable, "-m", "cli", "predict", str(path),
               "--data", str(data), "--output", str(out), "--strategy", strategy]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=environment(), check=False
    )
    assert result.returncode == 0, result.stderr
    expected = onnxruntime_outputs(path, x)
    got = np.load(out)["y"].reshape(expected.shape)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
