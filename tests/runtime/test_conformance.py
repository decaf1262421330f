"""One conformance suite over every executor: the same checks, whatever runs the ranks.

The `executor` fixture's values are the one executor (`runtime.rank_executor.RankExecutor`) as
each launcher runs it: `local` (`one_process`, as `legion-nn train` runs without mpiexec),
`threads×R` (R in-process ranks over `ThreadTransport`, R = 1..4), `mpiexec×2` (the MPI
transport) and `cluster×2` (the MPI transport across two emulated hosts, joined by a 1 Gbit/s
link; root and iproute2 only). Every value runs `tests.conformance_driver.exercise`, once per
module, and the tests below read what it measured:

- float64 gradients against central differences of the loss, each loss a real step of the same
  executor (see `test_gradients_equal_central_differences` for the tolerance);
- an epoch checkpointed at R ranks and resumed at another count, and an epoch resumed at R ranks
  from a checkpoint of another count, against an uninterrupted one-process run;
- the forward pass's losses and accuracies (a count of examples, so compared exactly);
- `tests.runtime.test_executor.MIXED` (dropout and BatchNorm): losses, parameters and running statistics
  after a few steps, and its evaluation.

Each value uses a strategy of its own (`VALUES`), so the partitioned values split the batch, the
channels and the rows; `tests/runtime/test_rank_executor.py` runs every strategy at every count.

Against the one-process run the values agree up to the order of their sums: the first step
differs only by it, within γ(n)·Σ|terms| for sums of n ≤ 486 terms (BatchNorm's statistics over
6×9×9 values), about 5e-14 relative to the terms; later steps carry forward the parameter
differences earlier updates left. 1e-9 relative leaves a factor 2e4 for the conditioning of
these sums and their growth over the run (measured at most 5e-12, the MIXED network's
parameters after 4 Adam steps on 3 and 4 ranks; its losses within 3e-14), while a piece run
twice or not at all, a dropped partial sum or another dropout mask moves them by 1e-4 or more.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime import cluster
from runtime.rank_executor import RankExecutor, one_process
from runtime.training import Trainer
from runtime.transport import ThreadTransport, run_threads
from tests.conformance_driver import (
    GRADIENT_BATCH,
    NETWORK,
    SEED,
    STALL_TIMEOUT,
    TRAIN_BATCH,
    Factory,
    H,
    config,
    exercise,
)
from tests.error_bounds import gamma
from tests.paths import ROOT

RTOL = 1e-9
JOB_TIMEOUT = 300

MPI_MISSING = "mpiexec not installed" if shutil.which("mpiexec") is None else None
CLUSTER_MISSING = (
    MPI_MISSING
    or ("the emulated cluster needs root" if os.geteuid() != 0 else None)
    or (
        "the emulated cluster needs iproute2 (ip, tc) and util-linux (nsenter, unshare)"
        if any(shutil.which(tool) is None for tool in ("ip", "tc", "nsenter", "unshare"))
        else None
    )
)


@dataclass(frozen=True)
class Value:
    launcher: str
    ranks: int
    strategy: str

    def __str__(self) -> str:
        return self.launcher if self.launcher == "local" else f"{self.launcher}x{self.ranks}"


def _value(launcher: str, ranks: int, strategy: str, missing: str | None = None):
    value = Value(launcher, ranks, strategy)
    marks = pytest.mark.skipif(missing is not None, reason=missing or "")
    return pytest.param(value, id=str(value), marks=marks)


VALUES = [
    _value("local", 1, "data"),
    _value("threads", 1, "spatial"),
    _value("threads", 2, "model"),
    _value("threads", 3, "spatial"),
    _value("threads", 4, "data"),
    _value("mpiexec", 2, "spatial", MPI_MISSING),
    _value("cluster", 2, "model", CLUSTER_MISSING),
]


def other_count(ranks: int) -> int:
    """The rank count a checkpoint written at `ranks` is resumed at, and the other way round."""
    return 1 if ranks > 1 else 2


def in_threads(ranks: int, body: Callable[[Factory], Any], strategy: str = "spatial") -> Any:
    """`body(new_executor)` on each of `ranks` in-process ranks; rank 0's result."""

    def rank(transport: ThreadTransport) -> Any:
        return body(
            lambda: RankExecutor(transport, strategy, seed=SEED, stall_timeout=STALL_TIMEOUT)
        )

    return run_threads(ranks, rank)[0]


def first_epoch_checkpoint(directory: Path, ranks: int) -> Path:
    cfg = config(NETWORK, TRAIN_BATCH, epochs=1, checkpoint_dir=str(directory))
    if ranks == 1:
        Trainer(cfg).run()
    else:
        in_threads(ranks, lambda new: Trainer(cfg, executor=new()).run())
    return directory


def resumed_epoch(checkpoint: Path, ranks: int, workdir: Path) -> list[float]:
    """The second epoch, resumed at `ranks` in process from a copy of `checkpoint`."""
    directory = shutil.copytree(checkpoint, workdir)
    cfg = config(NETWORK, TRAIN_BATCH, epochs=2, checkpoint_dir=str(directory), resume=True)
    if ranks == 1:
        return Trainer(cfg).run().losses
    return in_threads(ranks, lambda new: Trainer(cfg, executor=new()).run().losses)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[int, Path]:
    """First-epoch checkpoints written at 1 and at 2 ranks."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {ranks: first_epoch_checkpoint(root / f"at{ranks}", ranks) for ranks in (1, 2)}


@pytest.fixture(scope="module")
def uninterrupted() -> list[float]:
    """Two epochs' losses in one process, without a stop."""
    return Trainer(config(NETWORK, TRAIN_BATCH, epochs=2)).run().losses


def run_value(value: Value, workdir: Path, resume_from: Path) -> dict:
    if value.launcher == "local":
        return exercise(lambda: one_process(SEED, value.strategy), workdir, resume_from)
    if value.launcher == "threads":
        return in_threads(
            value.ranks, lambda new: exercise(new, workdir, resume_from), value.strategy
        )
    driver = [sys.executable, "-m", "tests.conformance_driver", "--strategy", value.strategy,
              "--out", str(workdir), "--resume-from", str(resume_from)]  # fmt: skip
    if value.launcher == "mpiexec":
        command = ["mpiexec", "-n", str(value.ranks), *driver]
    else:
        command = [sys.executable, "-m", "cli", "cluster", "run", "--name", CLUSTER,
                   "--hosts", str(value.ranks), "--link", "1gbit", "-n", str(value.ranks),
                   "--", *driver]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    job = subprocess.run(
        command, capture_output=True, text=True, timeout=JOB_TIMEOUT, env=env, check=False
    )
    assert job.returncode == 0, job.stderr
    if value.launcher == "cluster":
        assert not cluster_leftovers(), "the cluster job left these behind"
    return pickle.loads((workdir / "result.pkl").read_bytes())


#: this module's clusters are named for its process, so that the check for leftovers sees
#: them and not another user's
CLUSTER = f"c{os.getpid() % 10_000_000}"


def cluster_leftovers() -> list[str]:
    """What is left of this module's cluster: its namespaces and its state directory."""
    left = [name for name in cluster.existing_namespaces() if cluster.cluster_of(name) == CLUSTER]
    state = cluster.STATE_ROOT / CLUSTER
    return [*left, str(state)] if state.exists() else left


@pytest.fixture(scope="module")
def reference(checkpoints, tmp_path_factory) -> dict:
    """The one-process run's measurements (the `local` value's)."""
    return measured(Value("local", 1, "data"), checkpoints, tmp_path_factory)


@pytest.fixture(scope="module", params=VALUES)
def executor(request, reference, checkpoints, tmp_path_factory) -> dict:
    """What `exercise` measured on this value (see `measured`)."""
    value: Value = request.param
    if value.launcher == "local":
        return reference
    return measured(value, checkpoints, tmp_path_factory)


def measured(value: Value, checkpoints: dict[int, Path], tmp_path_factory) -> dict:
    """`exercise` on `value`, resuming a checkpoint written at another rank count, and its own
    first-epoch checkpoint (written at its rank count) resumed in process at another count."""
    workdir = tmp_path_factory.mktemp(str(value))
    resume_from = shutil.copytree(checkpoints[other_count(value.ranks)], workdir / "resume")
    results = run_value(value, workdir, resume_from)
    results["resumed_elsewhere"] = resumed_epoch(
        workdir / "checkpoint", other_count(value.ranks), workdir / "elsewhere"
    )
    return results


def assert_close(got, expected, what: str) -> None:
    """Equal up to the order of sums: within `RTOL` of the largest magnitude."""
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.shape == expected.shape, what
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
    assert float(np.abs(got - expected).max(initial=0.0)) <= RTOL * scale, what


def loss_rounding(loss: float) -> float:
    """ε, a bound on the rounding error of the computed loss, to first order.

    Each layer's output is a sum of `fan-in` rounded products (γ(fan-in) relative to the sum of
    their magnitudes); elementwise layers round once; the loss adds a sum over the classes and a
    mean over the batch. The nonlinearities between are 1-Lipschitz, so the relative errors add
    along the chain: γ(F)·|L| with F their total."""
    graph = NETWORK.lower(batch=GRADIENT_BATCH, dtype="float64")
    chain = NETWORK.classes + GRADIENT_BATCH
    for task in graph.tasks:
        if task.phase != "forward":
            continue
        weights = [r for r in task.requirements if r.role in ("filters", "weights")]
        if not weights:
            chain += 1
            continue
        dims = graph.tensors[weights[0].tensor].dims
        chain += math.prod(dims[3:6]) if len(dims) == 8 else math.prod(dims[1:])
    return gamma(chain) * abs(loss)


def test_gradients_equal_central_differences(executor, reference):
    """The gradient each update read against D(h) = (L(p + h) − L(p − h)) / 2h.

    With D(h) = g + c·h² + r(h), |r(h)| ≤ ε/h the round-off of two losses each within ε of
    their exact values (`loss_rounding`), D(h) − D(2h) = −3c·h² + r(h) − r(2h), so
        |D(h) − g| ≤ |D(h) − D(2h)| / 3 + 1.5·ε / h
    (to O(h⁴)): the truncation error measured on the loss itself, not a fixed ratio. Here that
    is about 7e-9 against gradients of 1e-3 to 0.5, where seed 002's relative 1e-5 (1e-2 for
    conv weights) would allow 2e-8 to 1e-5."""
    checked = executor["gradients"]
    epsilon = loss_rounding(checked["loss"])
    nonzero = 0
    for name, rows in checked["differences"].items():
        analytic = checked["analytic"][name].reshape(-1)
        for index, d_h, d_2h in rows:
            bound = abs(d_h - d_2h) / 3 + 1.5 * epsilon / H
            error = abs(analytic[index] - d_h)
            assert error <= bound, (name, index, analytic[index], d_h, error, bound)
            nonzero += analytic[index] != 0
    assert nonzero >= 12, "the check is vacuous: too few gradients are not zero"
    assert set(checked["analytic"]) == set(reference["gradients"]["analytic"])
    for name, expected in reference["gradients"]["analytic"].items():
        assert_close(checked["analytic"][name], expected, name)
    assert checked["loss"] == pytest.approx(reference["gradients"]["loss"], rel=RTOL)


def test_training_resumes_on_another_rank_count(executor, uninterrupted):
    """Checkpointed at this value's rank count and resumed at another, and the other way round:
    the losses of an uninterrupted run."""
    epoch = len(uninterrupted) // 2
    assert len(executor["first_epoch"]) == epoch == len(executor["resumed_epoch"])
    np.testing.assert_allclose(executor["first_epoch"], uninterrupted[:epoch], rtol=RTOL)
    np.testing.assert_allclose(executor["resumed_epoch"], uninterrupted[epoch:], rtol=RTOL)
    np.testing.assert_allclose(executor["resumed_elsewhere"], uninterrupted[epoch:], rtol=RTOL)


def test_evaluation_equals_the_one_process_run(executor, reference):
    splits = config(NETWORK, TRAIN_BATCH).dataset
    for split, examples in (("val", len(splits.val)), ("test", len(splits.test))):
        loss, accuracy = executor["evaluation"][split]
        expected_loss, expected_accuracy = reference["evaluation"][split]
        assert loss == pytest.approx(expected_loss, rel=RTOL), split
        correct = accuracy * examples
        assert correct == pytest.approx(round(correct), abs=1e-9), split  # a count of examples
        assert round(correct) == round(expected_accuracy * examples), split


def test_dropout_and_batchnorm_equal_the_one_process_run(executor, reference):
    got, expected = executor["mixed"], reference["mixed"]
    np.testing.assert_allclose(got["losses"], expected["losses"], rtol=RTOL)
    assert set(got["resident"]) == set(expected["resident"])
    assert {"bn0.running", "bn1.running"} <= set(got["resident"])  # BatchNorm's statistics
    for name, value in expected["resident"].items():
        assert_close(got["resident"][name], value, name)
    assert got["test"][0] == pytest.approx(expected["test"][0], rel=RTOL)
    assert got["test"][1] == expected["test"][1]
