"""The `gelu` layer: its kernels against NumPy and central differences, and a network using it
split over ranks against one process.

Each element is computed in float64: in float64 the kernels agree with the NumPy formulas to a
few ulps (libm's erf and tanh against NumPy's and SciPy's), in float32 to the rounding of the
stored result.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import erf

from legion_nn.errors import LegionNNError
from legion_nn.spec import network_from_dict
from runtime.kernels.gelu import gelu_backward, gelu_forward
from tests.test_rank_executor import assert_same, config, local_run, ranks_run

ULP64 = np.finfo(np.float64).eps


def reference(x: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "none":
        return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))
    u = np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)
    return 0.5 * x * (1.0 + np.tanh(u))


def inputs(dtype=np.float64, shape=(3, 4, 5, 6)) -> np.ndarray:
    # both tails, where erf and tanh saturate, and the bend around 0
    x = np.random.default_rng(7).standard_normal(shape) * 3.0
    x.flat[:4] = (-40.0, -6.0, 0.0, 40.0)
    return x.astype(dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_the_forward_is_numpys_formula(approximate):
    x = inputs()
    got, want = gelu_forward(x, approximate), reference(x, approximate)
    # a few roundings in each formula of terms no larger than |x|
    np.testing.assert_allclose(got, want, rtol=0, atol=16 * ULP64 * np.abs(x).max())
    x32 = x.astype(np.float32)
    got32 = gelu_forward(x32, approximate)
    assert got32.dtype == np.float32
    # the float64 value of the float32 input, rounded once
    want32 = reference(x32.astype(np.float64), approximate)
    np.testing.assert_allclose(got32, want32, rtol=2.0**-23, atol=16 * ULP64 * np.abs(x).max())


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_the_backward_is_the_central_difference(approximate):
    x = inputs()
    dy = np.random.default_rng(8).standard_normal(x.shape)
    h = 1e-5
    numeric = (reference(x + h, approximate) - reference(x - h, approximate)) / (2 * h) * dy
    # the difference's truncation, h² |f'''| / 6 with |f'''| < 2 here, and its rounding
    bound = (h * h / 3 + 8 * ULP64 * 40.0 / h) * np.abs(dy)
    assert np.all(np.abs(gelu_backward(dy, x, approximate) - numeric) <= bound)


def test_a_bad_form_is_named():
    with pytest.raises(ValueError, match="approximate must be one of"):
        gelu_forward(inputs(), "erf")
    with pytest.raises(LegionNNError, match="approximate must be one of none, tanh"):
        network_from_dict(
            {"name": "g", "input": [4], "classes": 2,
             "layers": [{"kind": "gelu", "approximate": "erf"}]},
            "g.json",
        )  # fmt: skip


def gelu_network():
    return network_from_dict(
        {
            "name": "gelu-mlp",
            "input": [2, 6, 6],
            "classes": 4,
            "layers": [
                {"kind": "filter", "name": "A", "out_channels": 3, "kernel": 3, "pad": 1},
                {"kind": "gelu"},
                {"kind": "linear", "name": "fc", "out": 16},
                {"kind": "gelu", "approximate": "tanh"},
                {"kind": "linear", "name": "classifier", "out": 4},
                {"kind": "softmax"},
                {"kind": "evaluate"},
            ],
        },
        "gelu-mlp",
    )


@pytest.mark.parametrize(("strategy", "nranks"), [("data", 2), ("model", 3), ("spatial", 2)])
def test_a_network_of_gelus_split_over_ranks_equals_one_process(strategy, nranks):
    cfg = config(gelu_network(), batch=6)
    assert_same(local_run(cfg), ranks_run(cfg, nranks, strategy))
