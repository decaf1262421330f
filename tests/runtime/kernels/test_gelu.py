"""The `gelu` layer: its kernels against NumPy and central differences, and a network using it
split over ranks against one process.

Each element is computed in float64: in float64 the kernels agree with the NumPy formulas to a
few ulps (libm's erf and tanh against NumPy's and SciPy's), in float32 to the rounding of the
stored result, the exact form's Φ being taken there to 1e-9 relative (`runtime.kernels.gelu`).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import erf, ndtr

from legion_nn.errors import LegionNNError
from legion_nn.spec import network_from_dict
from runtime.kernels.gelu import gelu_backward, gelu_forward
from tests.runtime.test_rank_executor import assert_same, config, local_run, ranks_run

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


#: the relative error of the float32 form's Φ and e^(−x²/2), with room: each is under 3e-10
FLOAT32_FORM = 1e-9


def test_the_exact_form_in_float32_is_the_float64_value_rounded_once_everywhere():
    # every float32 from −16 to 16 in steps of 2⁻¹³, through both tails and the bend: the value
    # in float64, off by at most 1e-9 of itself, rounded once to float32
    x = np.arange(-16.0, 16.0, 2.0**-13).astype(np.float32)
    wide = x.astype(np.float64)
    want = wide * ndtr(wide)
    got = gelu_forward(x)
    assert got.dtype == np.float32
    # below −13 the form takes Φ as 0: x·Φ(x) is under 1e-36 there
    bound = (2.0**-24 + FLOAT32_FORM) * np.abs(want) + 1e-36
    assert np.all(np.abs(got - want) <= bound)


def test_the_exact_forms_slope_in_float32_is_within_its_bound_everywhere():
    x = np.arange(-16.0, 16.0, 2.0**-13).astype(np.float32)
    dy = np.random.default_rng(9).uniform(-2.0, 2.0, x.shape).astype(np.float32)
    wide = x.astype(np.float64)
    density = np.exp(-0.5 * wide * wide) / np.sqrt(2.0 * np.pi)
    want = dy.astype(np.float64) * (ndtr(wide) + wide * density)
    got = gelu_backward(dy, x)
    assert got.dtype == np.float32
    # the slope Φ + x·φ crosses 0 near −0.75, so its error is bounded by its terms' sizes
    terms = np.abs(dy) * (ndtr(wide) + np.abs(wide) * density)
    # below −13 the form takes the slope as 0: |Φ + x·φ| is under 3e-36 there
    bound = 2.0**-24 * np.abs(want) + FLOAT32_FORM * terms + 3e-36 * np.abs(dy)
    assert np.all(np.abs(got - want) <= bound)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_results_written_in_place_or_added_equal_those_returned(dtype, approximate):
    x = inputs(dtype)
    dy = np.random.default_rng(10).standard_normal(x.shape).astype(dtype)
    held = np.random.default_rng(11).standard_normal(x.shape).astype(dtype)
    for kernel, args in ((gelu_forward, (x,)), (gelu_backward, (dy, x))):
        alone = kernel(*args, approximate)
        out = np.full_like(x, np.nan)
        assert kernel(*args, approximate, out=out) is not alone
        np.testing.assert_array_equal(out, alone)
        out = held.copy()
        kernel(*args, approximate, out=out, add=True)
        # the sum rounded once, where `alone` was rounded before it: an ulp of each apart
        want = held.astype(np.float64) + alone
        eps = np.finfo(dtype).eps
        assert np.all(np.abs(out - want) <= eps * (np.abs(want) + np.abs(alone)))


def test_an_output_of_another_shape_or_strided_is_refused():
    x = inputs()
    with pytest.raises(ValueError, match="out must have shape"):
        gelu_forward(x, out=np.empty(x.size))
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        gelu_forward(x, out=np.empty(x.shape[::-1]).T)


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
