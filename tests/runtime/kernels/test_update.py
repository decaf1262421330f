import numpy as np
import pytest

from runtime.kernels.fill import set_zero
from runtime.kernels.update import adam_step, momentum_step, sgd_step
from tests.error_bounds import assert_close_to


def _arrays(shape, dtype, count, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(count)]


def _tol(dtype):
    return {"rtol": 1e-6, "atol": 1e-6} if dtype == np.float32 else {"rtol": 1e-13, "atol": 1e-15}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 4, 2, 5), (7,), (1, 1, 1, 1)])
def test_sgd(shape, dtype):
    param, grad = _arrays(shape, dtype, 2)
    expected = param.astype(np.float64) - 0.1 * grad
    sgd_step(param, 0.1).apply(grad)
    assert param.dtype == dtype
    np.testing.assert_allclose(param, expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_momentum_over_steps(dtype):
    param, grad = _arrays((4, 3, 3, 2), dtype, 2)
    buffer = np.zeros_like(param)
    p, b = param.astype(np.float64), np.zeros(param.shape)
    for step in range(3):  # torch.optim.SGD's momentum: b = μ·b + g; p −= lr·b
        g = grad * (step + 1)
        b = 0.9 * b + g
        p = p - 0.05 * b
        momentum_step(param, buffer, 0.05, 0.9).apply(g)
    np.testing.assert_allclose(buffer, b, **_tol(dtype))
    np.testing.assert_allclose(param, p, **_tol(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adam_over_steps(dtype):
    param, grad = _arrays((5, 2, 3), dtype, 2, seed=1)
    m, v = np.zeros_like(param), np.zeros_like(param)
    p, mm, vv = param.astype(np.float64), np.zeros(param.shape), np.zeros(param.shape)
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
    for t in range(1, 5):
        g = grad.astype(np.float64) * t
        mm = b1 * mm + (1 - b1) * g
        vv = b2 * vv + (1 - b2) * g * g
        p = p - lr * (mm / (1 - b1**t)) / (np.sqrt(vv / (1 - b2**t)) + eps)
        adam_step(param, m, v, lr, b1, b2, eps, t).apply((grad * t).astype(dtype))
    np.testing.assert_allclose(m, mm, **_tol(dtype))
    np.testing.assert_allclose(v, vv, **_tol(dtype))
    np.testing.assert_allclose(param, p, **_tol(dtype))


def test_adam_first_step_moves_by_lr():
    param = np.zeros((3,))
    adam_step(param, np.zeros(3), np.zeros(3), 0.1, 0.9, 0.99, 0, 1).apply(
        np.array([2.0, -0.5, 1e-3])
    )
    np.testing.assert_allclose(param, [-0.1, 0.1, -0.1])


def test_strided_and_fortran_pieces_update_in_place():
    whole, grad = _arrays((4, 6, 3), np.float64, 2)
    velocity = np.zeros((4, 6, 3))
    expected = whole.copy()
    expected[:, 1:4] += -0.5 * grad[:, 1:4]
    size = np.abs(whole)
    size[:, 1:4] += np.abs(0.5 * grad[:, 1:4])
    momentum_step(whole[:, 1:4], velocity[:, 1:4], 0.5, 0.0).apply(grad[:, 1:4])
    # p - lr·g in one rounding or two (fused or not): within the bound of a two-term sum
    assert_close_to(whole, expected, size, 2)
    np.testing.assert_array_equal(whole[:, [0, 4, 5]], expected[:, [0, 4, 5]])  # untouched
    assert not velocity[:, 4:].any()

    param_f, grad_f = (np.asfortranarray(a) for a in _arrays((3, 5), np.float64, 2))
    expected = param_f - 2.0 * grad_f
    size = np.abs(param_f) + np.abs(2.0 * grad_f)
    sgd_step(param_f, 2.0).apply(grad_f)
    assert_close_to(param_f, expected, size, 2)


def test_bad_arguments():
    param, grad = _arrays((3, 2), np.float64, 2)
    with pytest.raises(ValueError, match=r"grad must have shape \(3, 2\)"):
        sgd_step(param, 0.1).apply(grad.T)
    with pytest.raises(ValueError, match="grad dtype float32"):
        sgd_step(param, 0.1).apply(grad.astype(np.float32))
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        adam_step(param, grad.copy(), grad.copy(), 0.1, 0.9, 0.99, 1e-8, 0)


def test_set_zero_in_place():
    a = np.ones((3, 4, 2, 2), np.float32)
    set_zero(a[:, 1:3])
    assert a[:, 1:3].sum() == 0 and a.sum() == 3 * 2 * 4
    with pytest.raises(ValueError, match="read-only"):
        set_zero(np.broadcast_to(np.ones(2), (3, 2)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adam_over_several_parallel_chunks_and_a_ragged_end(dtype):
    from runtime.kernels.update import CHUNK

    n = 2 * CHUNK + 7
    rng = np.random.default_rng(3)
    param, grad = (rng.standard_normal(n).astype(dtype) for _ in range(2))
    m, v = (rng.random(n).astype(dtype) for _ in range(2))
    p64, g64, m64, v64 = (a.astype(np.float64) for a in (param, grad, m, v))
    lr, b1, b2, eps, t = 1e-2, 0.9, 0.999, 1e-8, 3
    m64 = b1 * m64 + (1 - b1) * g64
    v64 = b2 * v64 + (1 - b2) * g64 * g64
    p64 = p64 - lr * (m64 / (1 - b1**t)) / (np.sqrt(v64 / (1 - b2**t)) + eps)
    adam_step(param, m, v, lr, b1, b2, eps, t).apply(grad)
    np.testing.assert_allclose(m, m64, **_tol(dtype))
    np.testing.assert_allclose(v, v64, **_tol(dtype))
    np.testing.assert_allclose(param, p64, **_tol(dtype))
