"""ONNX's own model-zoo test set (`onnx/backend/test/data/light/`, shipped with the `onnx`
package): the models legion-nn reads predict the set's reference outputs.

Their weights are ConstantOfShape nodes, folded at import (`onnx_fold`); their input is
`arange(n).reshape(shape) / n` in float32, and `light_<name>_output_0.pb` the expected output,
within onnxruntime's tolerance for the set (rtol 1e-3, atol 1e-5).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from legion_nn.importers.onnx_fold import fold
from legion_nn.importers.onnx_model import load_onnx
from tests.test_onnx_transformers import probabilities

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


@pytest.mark.parametrize("name", ["squeezenet"])
def test_a_model_of_the_set_predicts_its_reference_output(name):
    network = load_onnx(LIGHT / f"light_{name}.onnx")
    count = int(np.prod(network.input))
    x = (np.arange(count).reshape(1, *network.input) / count).astype(np.float32)
    expected = numpy_helper.to_array(onnx.load_tensor(str(LIGHT / f"light_{name}_output_0.pb")))
    got = probabilities(network, x.astype(np.float64))
    np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-3, atol=1e-5)


def test_with_random_weights_it_predicts_what_onnxruntime_predicts(tmp_path):
    """The set's weights are constant per tensor, so its reference output is uniform (0.001 for
    every class) and says little about the graph; with the same nodes and seeded random weights
    in place of the ConstantOfShape nodes, legion-nn predicts what onnxruntime predicts."""
    import onnxruntime as ort

    network = load_onnx(LIGHT / "light_squeezenet.onnx")
    model = onnx.load(str(LIGHT / "light_squeezenet.onnx"))
    # the weights in ONNX's shapes (the layers' are reshapes of them): ConstantOfShape nodes,
    # and initializers (opset 9 lists them among the graph's inputs too)
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    shapes = {name: value.shape for name, value in {**fold(model, 1).constants, **stored}.items()}
    rng = np.random.default_rng(7)
    weights = {
        name: (rng.standard_normal(shapes[name]) * 0.1).astype(np.float32)
        for name in network.initial
    }
    kept = [n for n in model.graph.node if not set(n.output) & set(weights)]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    initializers = [t for t in model.graph.initializer if t.name not in weights]
    del model.graph.initializer[:]
    model.graph.initializer.extend(initializers)
    for name, value in weights.items():
        model.graph.initializer.append(numpy_helper.from_array(value, name))
    path = tmp_path / "random.onnx"
    onnx.save(model, str(path))
    x = np.random.default_rng(8).standard_normal((1, *network.input)).astype(np.float32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {session.get_inputs()[0].name: x})
    ours = {k: v.reshape(network.initial[k].shape) for k, v in weights.items()}
    got = probabilities(network, x.astype(np.float64), ours)
    assert expected.std() > 1e-4  # no longer uniform
    np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-3, atol=1e-5)
