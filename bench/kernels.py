"""`legion-nn bench kernels`: filter throughput beside the machine's SGEMM and its peers.

Each pass (forward, backward_data, backward_filter) of the filter op runs at one layer shape,
by default the seed's L1 (C = K = 64, a 7×7 window, 27×27 outputs of a 33×33 input), untied
and tied, for each batch size, in float32, and is reported in GFLOP/s with
FLOPs = 2·N·K·C·R·S·P·Q per pass. Implementations:

- `legion-nn`: the packed kernels (`runtime.kernels.filter_packed`) on packed operands and
  preallocated outputs, as an executor that keeps its layouts runs them; best of `rounds`
  sweeps of `repeat` calls (each after an untimed call, as for every implementation).
- `numpy`: the plain references of `runtime.kernels.reference` on logical arrays; they take
  seconds, so each is timed with a single call.
- `torch` (when importable): untied as unfold + bmm (the usual locally connected layer),
  tied as conv2d and `torch.nn.grad.conv2d_input` / `conv2d_weight`; best of `peer_repeat`.

The ceiling is a 2048² float32 `np.matmul`, measured at the start, before each group of kernel
measurements and after each of our passes, and the best of all kept. Our share of it
(`sgemm_share`, the table's %SGEMM) pairs each round's pass with the SGEMM measured just before
and after it, and is the median over rounds: on a shared machine whose speed moves by a third
from one second to the next (an Intel Xeon VM, SGEMM 210-327 GFLOP/s a second apart), a best
over a dozen ceilings against a best over three passes is a rate over a ceiling caught at
another moment. When the
environment pins OpenBLAS's kernels (`OPENBLAS_CORETYPE`, read once when the library loads),
the same SGEMM is also measured in a child process without that setting, with the kernels
OpenBLAS picks for the CPU, and the ceiling is the faster of the two: an AVX2 core type on an
AVX-512 machine halves the SGEMM, and a ceiling below what the machine does is no ceiling.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.calibration import memory_bandwidth
from bench.machine_facts import blas_in_use, describe, machine_facts
from bench.timing import call_seconds, ceilings_beside
from runtime.aligned import aligned_empty
from runtime.kernels import reference
from runtime.kernels.filter_packed import (
    backward_data_packed,
    backward_filter_packed,
    forward_packed,
)
from runtime.kernels.layout import pack_activations, pack_weights

PASSES = ("forward", "backward_data", "backward_filter")
IMPLS = ("legion-nn", "numpy", "torch")


@dataclass(frozen=True)
class LayerShape:
    """A stride-1, unpadded filter layer: input (C, P+R−1, Q+S−1), output (K, P, Q)."""

    c: int
    k: int
    r: int
    s: int
    p: int
    q: int

    def flops(self, n: int) -> int:
        return 2 * n * self.k * self.c * self.r * self.s * self.p * self.q

    def as_dict(self, n: int) -> dict:
        return {
            "N": n,
            "C": self.c,
            "K": self.k,
            "R": self.r,
            "S": self.s,
            "P": self.p,
            "Q": self.q,
        }


SEED_L1 = LayerShape(c=64, k=64, r=7, s=7, p=27, q=27)


def best_seconds(fn: Callable[[], object], repeat: int, warm: bool = True) -> float:
    """Best wall time of `repeat` calls (`call_seconds`)."""
    return min(call_seconds(fn, repeat, warm))


@dataclass(frozen=True)
class CallCosts:
    """What one call of a pass costs besides its wall time, averaged over a sweep of calls:
    CPU seconds in user space and in the kernel (every thread of the process), and page faults.
    Time in the kernel is page faults on first touch, huge-page compaction, and threads that
    spin and yield while they wait for work: none of it is the pass's arithmetic."""

    user_s: float
    system_s: float
    page_faults: float


def measured(fn: Callable[[], object], repeat: int) -> tuple[float, CallCosts]:
    """`best_seconds` of `fn`, and the costs of its timed calls (`CallCosts`). The untimed
    first call is left out: it touches the output's pages for the first time, which a run does
    once, where its arena places the buffer, not at every step."""
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF)
    seconds = best_seconds(fn, repeat, warm=False)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return seconds, CallCosts(
        (after.ru_utime - before.ru_utime) / repeat,
        (after.ru_stime - before.ru_stime) / repeat,
        (after.ru_minflt - before.ru_minflt + after.ru_majflt - before.ru_majflt) / repeat,
    )


def pass_bytes(x: np.ndarray, w: np.ndarray, dy: np.ndarray) -> dict[str, int]:
    """The bytes each pass reads and writes once: its two operands and its result."""
    return {
        "forward": x.nbytes + w.nbytes + dy.nbytes,
        "backward_data": dy.nbytes + w.nbytes + x.nbytes,
        "backward_filter": x.nbytes + dy.nbytes + w.nbytes,
    }


#: a pass whose CPU time in the kernel passes this share of its CPU time is system-bound
SYSTEM_BOUND = 0.05
#: a pass that moves its bytes at this share of the copy bandwidth or more is memory-bound
MEMORY_BOUND = 0.5


def bound(costs: CallCosts, gbytes_per_s: float, bandwidth: float) -> str:
    """What limits a pass: "system" (its time in the kernel), "memory" (the bytes it moves,
    against the machine's copy bandwidth) or "compute"."""
    cpu = costs.user_s + costs.system_s
    if cpu > 0 and costs.system_s / cpu > SYSTEM_BOUND:
        return "system"
    if bandwidth > 0 and gbytes_per_s >= MEMORY_BOUND * bandwidth:
        return "memory"
    return "compute"


def sgemm_gflops(size: int = 2048, repeat: int = 5) -> float:
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    return 2 * size**3 / best_seconds(lambda: a @ a, repeat) / 1e9


def torch_sgemm_gflops(size: int = 2048, repeat: int = 5) -> float:
    """The peer's own SGEMM (PyTorch's BLAS, on its threads), beside NumPy's ceiling: whether a
    ratio to PyTorch comes from its GEMM or from its copies around it."""
    import torch

    a = torch.from_numpy(np.random.default_rng(0).standard_normal((size, size), dtype=np.float32))
    return 2 * size**3 / best_seconds(lambda: a @ a, repeat) / 1e9


def unpinned_environment() -> dict[str, str]:
    """This environment without `OPENBLAS_CORETYPE`: a child of it loads the BLAS kernels
    OpenBLAS picks for the CPU."""
    return {key: value for key, value in os.environ.items() if key != "OPENBLAS_CORETYPE"}


def sgemm_native(size: int = 2048, repeat: int = 5) -> dict | None:
    """SGEMM with the BLAS kernels OpenBLAS picks for this CPU, measured in a child process
    without `OPENBLAS_CORETYPE`: {"gflops", "blas"}; None when the environment does not pin a
    core type (the in-process SGEMM is then the native one). A failed child is a RuntimeError
    that names why."""
    if not os.environ.get("OPENBLAS_CORETYPE"):
        return None
    env = unpinned_environment()
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    code = f"from bench.kernels import _print_sgemm; _print_sgemm({size}, {repeat})"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])
    except subprocess.CalledProcessError as error:
        last = (error.stderr or "").strip().splitlines()[-1:] or [f"exit {error.returncode}"]
        raise RuntimeError(last[0]) from None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as error:
        raise RuntimeError(str(error) or type(error).__name__) from None


def sgemm_ceiling(size: int = 2048) -> tuple[float, dict | None]:
    """The machine's SGEMM GFLOP/s, the better of this process's and, where the environment
    pins OpenBLAS's core type, that of the kernels OpenBLAS would pick; and that native run
    (`sgemm_native`; None where nothing is pinned or its child failed)."""
    try:
        native = sgemm_native(size)
    except RuntimeError:
        native = None
    return max(sgemm_gflops(size), native["gflops"] if native else 0.0), native


def unpinned_scale(native: dict | None, in_process: list[float]) -> float:
    """How much faster, at best, the kernels OpenBLAS picks for the CPU ran than this process's
    pinned ones (`native` from `sgemm_native`, None: nothing pinned, 1): a rate paired with
    the in-process SGEMM beside it (`timing.ceilings_beside`) is set against that SGEMM times
    this."""
    return max(1.0, native["gflops"] / max(in_process)) if native else 1.0


def _print_sgemm(size: int, repeat: int) -> None:
    """The child's side of `sgemm_native`: one JSON line."""
    gflops = sgemm_gflops(size, repeat)
    print(json.dumps({"gflops": gflops, "blas": blas_in_use()["ceiling"]}))


def _operands(shape: LayerShape, n: int, untied: bool) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(n)
    h, w = shape.p + shape.r - 1, shape.q + shape.s - 1
    x = rng.standard_normal((n, shape.c, h, w), dtype=np.float32)
    positions = (shape.p, shape.q) if untied else (1, 1)
    wt = rng.standard_normal(
        (shape.k, 1, 1, shape.c, shape.r, shape.s, *positions), dtype=np.float32
    )
    dy = rng.standard_normal((n, shape.k, shape.p, shape.q), dtype=np.float32)
    return x, wt, dy


def _ours(x, w, dy, untied: bool) -> dict[str, Callable[[], object]]:
    # placed as the runtime places its buffers (`runtime.aligned`): NumPy's large arrays start
    # 16 bytes into a cache line, which splits every vector access of a row
    xp, wp, dyp = pack_activations(x), pack_weights(w), pack_activations(dy)
    y, dx, dw = (aligned_empty(a.shape, a.dtype) for a in (dyp, xp, wp))
    window, size = w.shape[4:6], x.shape[2:]
    return {
        "forward": lambda: forward_packed(xp, wp, out=y),
        "backward_data": lambda: backward_data_packed(dyp, wp, size, out=dx),
        "backward_filter": lambda: backward_filter_packed(dyp, xp, window, untied=untied, out=dw),
    }


def _numpy(x, w, dy, untied: bool) -> dict[str, Callable[[], object]]:
    return {
        "forward": lambda: reference.filter_forward(x, w),
        "backward_data": lambda: reference.filter_backward_data(dy, x.shape, w),
        "backward_filter": lambda: reference.filter_backward_filter(dy, x, w.shape),
    }


def _torch(x, w, dy, untied: bool) -> dict[str, Callable[[], object]]:
    import torch
    import torch.nn.functional as F

    n, _, h, wd = x.shape
    k, _, _, _, r, s, p, q = w.shape
    xt, dyt = torch.from_numpy(x), torch.from_numpy(dy)
    if not untied:
        w4 = torch.from_numpy(np.ascontiguousarray(w[:, 0, 0, :, :, :, 0, 0]))
        return {
            "forward": lambda: F.conv2d(xt, w4),
            "backward_data": lambda: torch.nn.grad.conv2d_input(xt.shape, w4, dyt),
            "backward_filter": lambda: torch.nn.grad.conv2d_weight(xt, w4.shape, dyt),
        }
    # one (K, C·R·S) matrix per output position, batched over positions (L = P·Q); operands
    # are made contiguous before bmm, which is several times faster than bmm on permuted views
    wl = torch.from_numpy(
        np.ascontiguousarray(w[:, 0, 0].transpose(4, 5, 0, 1, 2, 3).reshape(p * q, k, -1))
    )
    dyl = dyt.reshape(n, k, p * q).permute(2, 1, 0).contiguous()  # (L, K, N), a model's input

    def forward():
        cols = F.unfold(xt, (r, s)).permute(2, 1, 0).contiguous()  # (L, C·R·S, N)
        return torch.bmm(wl, cols).permute(2, 1, 0).reshape(n, k, p, q)

    def backward_data():
        cols = torch.bmm(wl.transpose(1, 2), dyl)  # (L, C·R·S, N)
        return F.fold(cols.permute(2, 1, 0).contiguous(), (h, wd), (r, s))

    def backward_filter():
        cols = F.unfold(xt, (r, s)).permute(2, 0, 1).contiguous()  # (L, N, C·R·S)
        return torch.bmm(dyl, cols)  # (L, K, C·R·S)

    return {"forward": forward, "backward_data": backward_data, "backward_filter": backward_filter}


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def run_benchmark(
    batches: tuple[int, ...] = (64, 256),
    repeat: int = 3,
    impls: tuple[str, ...] = IMPLS,
    shape: LayerShape = SEED_L1,
    progress: Callable[[str], None] | None = None,
    sgemm_size: int = 2048,
    peer_repeat: int = 2,
    rounds: int = 3,
    bandwidth_megabytes: int = 256,
) -> dict:
    """Measure every (batch, untied/tied, implementation, pass); the design's bench JSON.

    Ours is the best of `rounds` sweeps of `repeat` calls, PyTorch the best of `peer_repeat`
    calls (its untied passes take seconds), the NumPy reference one call.
    """
    makers = {"legion-nn": (_ours, repeat), "numpy": (_numpy, 1), "torch": (_torch, peer_repeat)}
    skipped = []
    if "torch" in impls and not torch_available():
        impls = tuple(i for i in impls if i != "torch")
        skipped.append("torch (not importable)")
    native: list[dict] = []

    def measure_native() -> None:
        try:
            run = sgemm_native(sgemm_size)
        except RuntimeError as error:
            skipped.append(f"SGEMM without OPENBLAS_CORETYPE ({error})")
            return
        if run:
            native.append(run)

    measure_native()
    facts = machine_facts()
    bandwidth = memory_bandwidth(bandwidth_megabytes)
    sgemm = [sgemm_gflops(sgemm_size)]
    peer_sgemm: list[float] = []
    best: dict[tuple, dict] = {}
    # implementation outermost: PyTorch's OpenMP threads keep spinning after its calls and
    # would slow whatever runs next, so it runs last. Ours, being fast, sweeps `rounds` times:
    # a best over calls spread across minutes survives a neighbour's burst on a shared machine
    shares: dict[tuple, list[float]] = {}
    for impl in impls:
        maker, times = makers[impl]
        if impl == "torch":
            peer_sgemm.append(torch_sgemm_gflops(sgemm_size))
        for _ in range(rounds if impl == "legion-nn" else 1):
            for n, untied in ((n, untied) for n in batches for untied in (True, False)):
                x, w, dy = _operands(shape, n, untied)
                sgemm.append(sgemm_gflops(sgemm_size, repeat=3))
                moved = pass_bytes(x, w, dy)
                for name, fn in maker(x, w, dy, untied).items():
                    seconds, costs = measured(fn, times)
                    key = (impl, n, untied, name)
                    if impl == "legion-nn":
                        sgemm.append(sgemm_gflops(sgemm_size, repeat=3))
                        (beside,) = ceilings_beside(sgemm[-2:])
                        shares.setdefault(key, []).append(shape.flops(n) / seconds / 1e9 / beside)
                    if key in best and best[key]["seconds"] <= seconds:
                        continue
                    best[key] = {
                        "op": "filter",
                        "pass": name,
                        "impl": impl,
                        "untied": untied,
                        "shape": shape.as_dict(n),
                        "gflops": shape.flops(n) / seconds / 1e9,
                        "seconds": seconds,
                        "cpu_user_s": costs.user_s,
                        "cpu_system_s": costs.system_s,
                        "page_faults": costs.page_faults,
                        "bytes": moved[name],
                        "gbytes_per_s": moved[name] / seconds / 1e9,
                        "bound": bound(costs, moved[name] / seconds / 1e9, bandwidth),
                    }
                    if progress:
                        layer = "untied" if untied else "tied"
                        progress(
                            f"{impl:9} {name:15} {layer:6} N={n:<4} "
                            f"{best[key]['gflops']:8.1f} GFLOP/s"
                        )
    if native:  # again at the end, the best kept, like the in-process ceiling
        measure_native()
    best_native = max(native, key=lambda run: run["gflops"]) if native else None
    unpinned = unpinned_scale(best_native, sgemm)
    for key, paired in shares.items():
        best[key]["sgemm_share"] = float(np.median(paired)) / unpinned
        best[key]["sgemm_shares"] = [share / unpinned for share in paired]
    return {
        "machine": facts,
        "memory_gbytes_per_s": bandwidth,
        "sgemm_gflops": max(max(sgemm), best_native["gflops"] if best_native else 0.0),
        "sgemm": f"{sgemm_size}x{sgemm_size} float32 np.matmul",
        "sgemm_configured_gflops": max(sgemm),
        "sgemm_configured": f"in this process, best of {len(sgemm)} rounds",
        "sgemm_native": best_native,
        "blas": blas_in_use(),
        "torch_sgemm_gflops": max(peer_sgemm) if peer_sgemm else None,
        "dtype": "float32",
        "repeat": repeat,
        "rounds": rounds,
        "peer_repeat": peer_repeat,
        "skipped": skipped,
        "results": list(best.values()),
    }


def format_table(report: dict) -> str:
    """One row per (pass, layer, batch), one GFLOP/s column per implementation; for ours, the
    share of its CPU time in the kernel, its page faults per call, the bytes it moves per
    second and what bounds it."""
    sgemm = report["sgemm_gflops"]
    rows: dict[tuple, dict[str, float]] = {}
    ours_costs: dict[tuple, dict] = {}
    for res in report["results"]:
        key = (res["pass"], res["untied"], res["shape"]["N"])
        rows.setdefault(key, {})[res["impl"]] = res["gflops"]
        if res["impl"] == "legion-nn":
            ours_costs[key] = res
    impls = [i for i in IMPLS if any(i in row for row in rows.values())]
    head = f"{'pass':16}{'layer':8}{'N':>5}" + "".join(f"{i:>11}" for i in impls)
    head += f"{'%SGEMM':>9}{'x numpy':>9}{'x torch':>9}{'sys%':>6}{'faults':>8}{'GB/s':>7}  bound"
    lines = [describe(report["machine"])] if report.get("machine") else []
    lines.append(f"SGEMM ceiling ({report['sgemm']}): {sgemm:.1f} GFLOP/s")
    if report.get("memory_gbytes_per_s"):
        lines.append(
            f"copy bandwidth (streaming loops on every thread): "
            f"{report['memory_gbytes_per_s']:.1f} GB/s"
        )
    blas = report.get("blas") or {}
    configured = report.get("sgemm_configured_gflops")
    if configured:
        lines.append(f"  as configured ({blas.get('ceiling', 'BLAS')}): {configured:.1f}")
    native = report.get("sgemm_native")
    if native:
        core = os.environ.get("OPENBLAS_CORETYPE", "set")
        lines.append(
            f"  without OPENBLAS_CORETYPE={core} ({native['blas']}, in a child process): "
            f"{native['gflops']:.1f}"
        )
    if blas:
        lines.append(f"BLAS: kernels {blas['kernels']}; ceiling {blas['ceiling']}")
    if report.get("torch_sgemm_gflops"):
        lines.append(
            f"PyTorch's own SGEMM (torch.mm, same size): {report['torch_sgemm_gflops']:.1f}"
        )
    lines += ["GFLOP/s:", head]
    order = sorted(rows, key=lambda key: (not key[1], key[2], PASSES.index(key[0])))
    for pass_, untied, n in order:
        row = rows[(pass_, untied, n)]
        line = f"{pass_:16}{'untied' if untied else 'tied':8}{n:5d}"
        line += "".join(f"{row[i]:11.1f}" if i in row else f"{'-':>11}" for i in impls)
        ours = row.get("legion-nn")
        mine = ours_costs.get((pass_, untied, n))
        share = mine.get("sgemm_share", ours / sgemm) if mine else None
        line += f"{share:9.0%}" if share is not None else f"{'-':>9}"
        for peer in ("numpy", "torch"):
            ok = ours and row.get(peer)
            line += f"{ours / row[peer]:8.1f}x" if ok else f"{'-':>9}"
        if mine and "cpu_system_s" in mine:
            cpu = mine["cpu_user_s"] + mine["cpu_system_s"]
            line += f"{mine['cpu_system_s'] / cpu if cpu else 0.0:6.1%}"
            line += f"{mine['page_faults']:8.0f}{mine['gbytes_per_s']:7.1f}  {mine['bound']}"
        lines.append(line)
    lines.append(
        f"legion-nn: packed layouts, best of {report['rounds']} rounds x {report['repeat']} "
        f"calls; numpy: one call; torch: best of {report['peer_repeat']} calls"
    )
    if any("sgemm_share" in res for res in ours_costs.values()):
        lines.append(
            "%SGEMM: the median over rounds of our pass's rate over the SGEMM measured just "
            "before and after it (the faster of the two): a shared machine's speed moves "
            "between seconds, and a rate over a ceiling caught at another moment does not"
        )
    if ours_costs:
        lines.append(
            f"legion-nn's calls: sys% their CPU time in the kernel, faults their page faults, "
            f"GB/s the bytes of operands and result over the time; bound: system past "
            f"{SYSTEM_BOUND:.0%} in the kernel, memory at {MEMORY_BOUND:.0%} of the copy "
            f"bandwidth or more, else compute"
        )
    if report["skipped"]:
        lines.append("skipped: " + ", ".join(report["skipped"]))
    return "\n".join(lines)
