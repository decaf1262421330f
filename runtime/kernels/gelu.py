"""The `gelu` op: the Gaussian error linear unit, exact or in its tanh approximation.

Exact (PyTorch's `approximate="none"`, ONNX's Gelu): y = x·Φ(x) = ½x(1 + erf(x/√2)), whose
derivative is Φ(x) + x·φ(x). Tanh (`approximate="tanh"`, GPT-2's): y = ½x(1 + tanh u) with
u = √(2/π)(x + 0.044715x³), whose derivative is ½(1 + tanh u) + ½x(1 − tanh²u)·√(2/π)(1 +
3·0.044715x²). Neither derivative is a function of y alone, so the backward reads the forward's
input (filterNL's read its output). Each element is computed in float64 and stored in the
array's dtype; the exact form to the precision that dtype keeps (below).

For float64 arrays the exact form reads Φ and its slope from tables rather than calling libm's
erf and exp, which took 7 ns an element (a GPT step spent a quarter of its time there): on [−14, 10], cut into
pieces of 1/8, each function is its Chebyshev interpolant of degree 8, built when the module is
imported from `math.erfc` and evaluated by Clenshaw's recurrence. The interpolation error is
below 1e-17 (the 9th derivative of Φ is under 40); what remains is the recurrence's rounding,
a few ulps. Beyond the range, Φ and the slope are 0 (below −14, where x·Φ(x) < 1e-43) or 1.

A float32 array needs Φ to 1e-9 relative, not 1e-16, since its result is rounded to 2⁻²⁴. Its
exact form is computed in float64 without tables, the coefficients' gathers being what the
tables cost on AVX-512 (3 ns an element): erfc(z) = e^(−z²)·t·q(t), t = 1/(1 + 0.4z), z = |x|/√2,
with q a polynomial of degree 11 in t fitted to erfcx(z)/t when the module is imported (relative
error under 2e-10 for z ≤ 9.5), and e^(−z²) from a degree-9 polynomial on the argument reduced by
multiples of ln 2, scaled by 2^k built from its bits (relative error under 3e-10). Below −13 Φ is
0 (x·Φ(x) < 1e-37), above 13 it is 1. Twice as fast as the tables; the result is the float64
value rounded once, but where the 1e-9 decides a rounding, one float32 ulp away.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from runtime.kernels import _checks

#: PyTorch's names for the two forms
APPROXIMATIONS = {"none": 0, "tanh": 1}
#: the kernels' code of the exact form to float32's precision (`gelu_forward` picks it)
EXACT_FLOAT32 = 2

_SQRT_HALF = math.sqrt(0.5)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_CUBIC = 0.044715


#: the tables' range, pieces per unit and degree
TABLE_LO, TABLE_HI, PIECES_PER_UNIT, DEGREE = -14.0, 10.0, 8, 8


def _tables() -> np.ndarray:
    """(2, pieces, DEGREE + 1): the Chebyshev coefficients of Φ and of its slope Φ + x·φ on
    each piece, from their values at the piece's Chebyshev points."""
    n = DEGREE + 1
    theta = np.pi * (np.arange(n) + 0.5) / n
    pieces = round((TABLE_HI - TABLE_LO) * PIECES_PER_UNIT)
    x = TABLE_LO + (np.arange(pieces)[:, None] + 0.5 + np.cos(theta)[None, :] / 2) / PIECES_PER_UNIT
    phi = 0.5 * np.vectorize(math.erfc)(-x * _SQRT_HALF)
    slope = phi + x * _INV_SQRT_2PI * np.exp(-0.5 * x * x)
    basis = np.cos(np.outer(np.arange(n), theta)) * (2.0 / n)
    basis[0] /= 2
    return np.ascontiguousarray(np.stack([phi @ basis.T, slope @ basis.T]))


TABLES = _tables()


#: float32's form: the map t = 1/(1 + T_SCALE·z), the degree of q, and the z beyond which
#: erfc(z) is taken at Z_MAX (erfc(9.5) < 1e-40); Φ is 0 at or below X_LO
T_SCALE, Q_DEGREE, Z_MAX, X_LO = 0.4, 11, 9.5, -13.0


def _q_coefficients() -> tuple[float, ...]:
    """q's coefficients, lowest first: the least-squares fit of t·q(t) to erfcx(z) relative to
    erfcx, at 400 Chebyshev points of t in [1/(1 + T_SCALE·Z_MAX), 1]."""
    n = 400
    t_lo = 1.0 / (1.0 + T_SCALE * Z_MAX)
    t = t_lo + (np.cos(np.pi * (np.arange(n) + 0.5) / n) + 1.0) / 2.0 * (1.0 - t_lo)
    z = (1.0 / t - 1.0) / T_SCALE
    erfcx = np.array([math.exp(v * v) * math.erfc(v) for v in z])
    basis = t[:, None] ** np.arange(1, Q_DEGREE + 2)[None, :] / erfcx[:, None]
    found, *_ = np.linalg.lstsq(basis, np.ones(n), rcond=None)
    return tuple(float(c) for c in found)


Q0, Q1, Q2, Q3, Q4, Q5, Q6, Q7, Q8, Q9, Q10, Q11 = _q_coefficients()

#: e^a's argument reduction a = k·ln 2 + r (ln 2 in two parts, the first exact times any k
#: here), and the constant whose addition rounds to an integer
_LOG2E = 1.0 / math.log(2.0)
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_ROUNDING = 1.5 * 2.0**52


@intrinsic
def _float64_from_bits(typingctx, bits):
    """The float64 whose bits are the int64 `bits` (a bitcast, which vectorises)."""
    if bits != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


@njit(cache=True, nogil=True, inline="always", fastmath={"contract"})
def _exp_down(a):
    """e^a for a in [−85, 0], to 3e-10 relative: Taylor's degree 9 at |r| ≤ ln 2 / 2."""
    k = (a * _LOG2E + _ROUNDING) - _ROUNDING
    r = (a - k * _LN2_HI) - k * _LN2_LO
    p = 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    return p * _float64_from_bits((np.int64(k) + 1023) << 52)


@njit(cache=True, nogil=True, inline="always", fastmath={"contract"})
def _phi_and_density(v):
    """(Φ(v), e^(−v²/2)) to float32's precision (see the module docstring)."""
    clamped = min(max(v, X_LO), -X_LO)
    z = min(abs(clamped) * _SQRT_HALF, Z_MAX)
    t = 1.0 / (1.0 + T_SCALE * z)
    q = Q11
    q = q * t + Q10
    q = q * t + Q9
    q = q * t + Q8
    q = q * t + Q7
    q = q * t + Q6
    q = q * t + Q5
    q = q * t + Q4
    q = q * t + Q3
    q = q * t + Q2
    q = q * t + Q1
    q = q * t + Q0
    gauss = _exp_down(-0.5 * clamped * clamped)
    half_erfc = 0.5 * gauss * t * q
    phi = 1.0 - half_erfc if v >= 0.0 else half_erfc
    return (0.0 if v <= X_LO else phi), gauss


#: elements per parallel chunk of the flat loops
CHUNK = 4096


@njit(cache=True, nogil=True, inline="always")
def _interpolated(tables, which, v):
    """Φ (`which` 0) or its slope (1) at v, from `TABLES`: branch-free but for the final
    choice, so that the loop over elements vectorises (the coefficients are gathered)."""
    u = (min(max(v, TABLE_LO), TABLE_HI - 1e-9) - TABLE_LO) * PIECES_PER_UNIT
    piece = int(u)
    z = 2.0 * (u - piece) - 1.0
    b1 = 0.0
    b2 = 0.0
    for k in range(DEGREE, 0, -1):
        b0 = tables[which, piece, k] + 2.0 * z * b1 - b2
        b2 = b1
        b1 = b0
    inside = tables[which, piece, 0] + z * b1 - b2
    return 1.0 if v >= TABLE_HI else (inside if v > TABLE_LO else (0.0 if v <= TABLE_LO else v))


@njit(cache=True, nogil=True, inline="always")
def _tanh_value(v):
    return 0.5 * v * (1.0 + math.tanh(_SQRT_2_OVER_PI * (v + _CUBIC * v * v * v)))


@njit(cache=True, nogil=True, inline="always")
def _tanh_slope(v):
    t = math.tanh(_SQRT_2_OVER_PI * (v + _CUBIC * v * v * v))
    return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * _SQRT_2_OVER_PI * (
        1.0 + 3.0 * _CUBIC * v * v
    )


# parallel loops only, unlike the kernels of `runtime.kernels.threaded`: with plain loops these
# compiled in 4.6-5.3 s against 3.9 s with parallel ones (`compile_units`'s gelu unit on an empty
# cache), so a rank with one thread runs the parallel ones
@njit(cache=True, nogil=True, parallel=True, fastmath={"contract"})
def _forward(x, code, tables, y, add):
    n = x.size
    for chunk in prange((n + CHUNK - 1) // CHUNK):
        lo, hi = chunk * CHUNK, min(n, (chunk + 1) * CHUNK)
        # into a chunk of scratch, then copied or added: the loops stay free of that choice, and
        # of any store that may alias the tables, either of which keeps them from vectorising
        into = np.empty(hi - lo, y.dtype)
        if code == 0:
            for i in range(hi - lo):
                v = np.float64(x[lo + i])
                into[i] = v * _interpolated(tables, 0, v)
        elif code == EXACT_FLOAT32:
            for i in range(hi - lo):
                v = np.float64(x[lo + i])
                into[i] = v * _phi_and_density(v)[0]
        else:
            for i in range(hi - lo):
                into[i] = _tanh_value(np.float64(x[lo + i]))
        if add:
            y[lo:hi] += into
        else:
            y[lo:hi] = into


@njit(cache=True, nogil=True, parallel=True, fastmath={"contract"})
def _backward(dy, x, code, tables, dx, add):
    n = x.size
    for chunk in prange((n + CHUNK - 1) // CHUNK):
        lo, hi = chunk * CHUNK, min(n, (chunk + 1) * CHUNK)
        into = np.empty(hi - lo, dx.dtype)
        if code == 0:
            for i in range(hi - lo):
                slope = _interpolated(tables, 1, np.float64(x[lo + i]))
                into[i] = np.float64(dy[lo + i]) * slope
        elif code == EXACT_FLOAT32:
            for i in range(hi - lo):
                v = np.float64(x[lo + i])
                phi, gauss = _phi_and_density(v)
                slope = 0.0 if v <= X_LO else phi + v * _INV_SQRT_2PI * gauss
                into[i] = np.float64(dy[lo + i]) * slope
        else:
            for i in range(hi - lo):
                into[i] = np.float64(dy[lo + i]) * _tanh_slope(np.float64(x[lo + i]))
        if add:
            dx[lo:hi] += into
        else:
            dx[lo:hi] = into


def _flat(name: str, a: np.ndarray) -> np.ndarray:
    """A float array of any rank as a contiguous 1-d view (a copy where it is strided)."""
    _checks.floating(name, a)
    return np.ascontiguousarray(a).reshape(-1)


def _kernel_code(approximate: str, dtype: np.dtype) -> int:
    """The kernels' code of `approximate` for arrays of `dtype`."""
    code = _checks.code("approximate", approximate, APPROXIMATIONS)
    return EXACT_FLOAT32 if code == 0 and dtype == np.float32 else code


def gelu_forward(
    x: np.ndarray, approximate: str = "none", out: np.ndarray | None = None, add: bool = False
) -> np.ndarray:
    """y = gelu(x) elementwise, into `out` where given, or added to what it holds with `add`."""
    flat = _flat("x", x)
    code = _kernel_code(approximate, flat.dtype)
    y = _checks.output_or_new(out, x.shape, "the input", x).reshape(-1)
    _forward(flat, code, TABLES, y, add and out is not None)
    return y.reshape(x.shape)


def gelu_backward(
    dy: np.ndarray,
    x: np.ndarray,
    approximate: str = "none",
    out: np.ndarray | None = None,
    add: bool = False,
) -> np.ndarray:
    """dx = dy·gelu'(x), from the forward's input x; into `out` where given, or added to what it
    holds with `add`."""
    flat = _flat("dy", dy)
    code = _kernel_code(approximate, flat.dtype)
    _checks.like("x", x, "dy", dy)
    dx = _checks.output_or_new(out, dy.shape, "the input", dy).reshape(-1)
    _backward(flat, _flat("x", x), code, TABLES, dx, add and out is not None)
    return dx.reshape(dy.shape)
