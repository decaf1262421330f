"""What the conformance suite asks of an executor, run by every rank of it.

`exercise` is the same code for every executor value of `tests/runtime/test_conformance.py`: called with
one rank's transport it runs, in float64,

- a frozen step (SGD, lr 0) of `NETWORK` and the gradients it computes, as the updates read them
  (gathered from every rank's update pieces to rank 0), then central differences of the loss
  through real steps of the same executor at steps h and 2h for a few entries of each parameter;
- one epoch of training with a checkpoint (written at this executor's rank count), the forward
  pass's losses and accuracies on the validation and test splits, and a second epoch resumed
  from a checkpoint written at another rank count;
- a few steps of `tests.runtime.test_executor.MIXED` (dropout and BatchNorm) with its parameters and
  running statistics after them, and its evaluation.

Rank 0 returns the results; the other ranks return None. In-process values call `exercise` from
threads; the MPI values run this module under `mpiexec` (`python -m tests.conformance_driver`),
whose rank 0 pickles the results to `OUT/result.pkl`.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.network import Network
from legion_nn.spec import network_from_dict
from runtime import data
from runtime.adapters import StepContext
from runtime.rank_executor import RankExecutor
from runtime.training import TrainConfig, Trainer
from runtime.transport import Transport, wait_object
from tests.runtime.test_executor import MIXED

SEED = 4
#: the gradient check's batch: uneven over 2, 3 and 4 ranks
GRADIENT_BATCH = 5
#: training batch: 49 training samples make 7 steps an epoch, the last one short
TRAIN_BATCH = 8
MIXED_BATCH, MIXED_STEPS = 6, 4
#: the finite-difference step: truncation (~h²·|f'''|) and round-off (~ε/h for a loss computed
#: within ε ~ 1e-14) are about balanced here
H = 1e-5
PICKS = 4
STALL_TIMEOUT = 120.0
#: a control tag of this module's own (the executor's are below 20)
TAG_PARAMS = 20

NETWORK = network_from_dict(
    {
        "name": "conformance",
        "input": [1, 10, 10],
        "classes": 4,
        "layers": [
            {"kind": "filter", "name": "L0", "out_channels": 3, "kernel": [3, 3], "untied": True},
            {"kind": "filterA"},
            {"kind": "filterNL", "fn": "relu"},
            {"kind": "filter", "name": "L1", "out_channels": 2, "kernel": [3, 3], "pad": 1},
            {"kind": "filterNL", "fn": "tanh"},
            {"kind": "linear", "name": "classifier", "out": 4},
            {"kind": "softmax"},
            {"kind": "evaluate"},
        ],
    },
    "conformance",
)

#: makes a fresh executor (fresh parameters) of this rank
Factory = Callable[[], RankExecutor]


def config(network: Network, batch: int, **extra: Any) -> TrainConfig:
    dataset = data.synthetic(network.input, network.classes, seed=3, samples=70, dtype=np.float64)
    return TrainConfig(
        network=network, dataset=dataset, batch=batch, dtype="float64", seed=SEED, **extra
    )


def exercise(new_executor: Factory, workdir: Path, resume_from: Path) -> dict[str, Any] | None:
    """Every check's measurements on this rank's executors; rank 0 gets them, others None.

    `resume_from` holds a checkpoint after the first epoch, written at another rank count; the
    resumed run writes its own checkpoints there. This run's first-epoch checkpoint goes to
    `workdir / "checkpoint"`."""
    first = new_executor()
    results = {
        "gradients": gradient_check(first),
        **train_and_resume(new_executor, workdir / "checkpoint", resume_from),
        "mixed": mixed(new_executor()),
    }
    return results if first.is_root else None


def loss_tensor(graph: TaskGraph) -> str:
    loss = next(t for t in graph.tasks if t.op == "softmax" and t.phase == "forward")
    return loss.requirement("output").tensor


def broadcast(transport: Transport, value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    if transport.rank == 0:
        for dst in range(1, transport.size):
            transport.send_object(value, dst, TAG_PARAMS)
        return value
    request = transport.recv_object(0, TAG_PARAMS)
    return wait_object(request, 0, "receiving the parameters", transport.rank, STALL_TIMEOUT)


def gathered_gradients(executor: RankExecutor, graph: TaskGraph) -> dict[str, np.ndarray] | None:
    """Each parameter's gradient as its update read it, whole and logical, on rank 0.

    Every rank sends the gradient rects of its update pieces; where several ranks update the same
    rect (replicated parameters) their copies must agree, since each goes on to update a copy of
    the same parameter."""
    program = executor.prepare(graph).step
    parts = []
    for rank_task in program.tasks:
        if rank_task.task.phase != "update":
            continue
        param = rank_task.task.requirement("params").tensor
        for piece in rank_task.pieces:
            for req in piece.requirements:
                if req.role == "gradient":
                    view = executor.view(req.tensor, req.rect)
                    block = np.array(executor.layouts[req.tensor].to_logical(view))
                    parts.append((param, req.rect, block))
    everyone = executor.gather(parts)
    if everyone is None:
        return None
    out: dict[str, np.ndarray] = {}
    for rank, rank_parts in enumerate(everyone):
        for name, rect, block in rank_parts:
            whole = out.setdefault(name, np.full(graph.tensors[name].dims, np.nan))
            held = whole[rect.to_slices()]
            seen = ~np.isnan(held)
            if np.any(held[seen] != block[seen]):
                raise AssertionError(f"rank {rank}'s gradient of {name} differs from another's")
            whole[rect.to_slices()] = block
    for name, whole in out.items():
        if np.isnan(whole).any():
            raise AssertionError(f"no update read part of the gradient of {name}")
    return out


def gradient_check(executor: RankExecutor) -> dict[str, Any] | None:
    """The analytic gradients of a frozen step and, for `PICKS` entries of each parameter, the
    central differences of the loss at steps H and 2H, each loss from a real step."""
    graph = NETWORK.lower(
        batch=GRADIENT_BATCH, dtype="float64", optimizer="sgd", hyperparameters={"lr": 0.0}
    )
    rng = np.random.default_rng(1)
    x = rng.standard_normal((GRADIENT_BATCH, *NETWORK.input))
    y = rng.integers(0, NETWORK.classes, GRADIENT_BATCH).astype(np.int32)
    executor.keep_step_tensors = True  # it reads the gradients: no update fused into a kernel
    executor.prepare(graph)
    initial = broadcast(executor.transport, executor.resident())
    loss_name = loss_tensor(graph)

    def loss() -> float | None:
        executor.run(graph, StepContext(0, inputs=x, labels=y))
        value = executor.value(loss_name)
        return float(value.reshape(-1)[0]) if executor.is_root else None

    base = loss()
    analytic = gathered_gradients(executor, graph)
    picks = np.random.default_rng(2)
    checks: dict[str, list[tuple[int, float | None, float | None]]] = {}
    for name in sorted(n for n in initial if graph.tensors[n].kind == "param"):
        flat_size = initial[name].size
        indices = picks.choice(flat_size, size=min(PICKS, flat_size), replace=False)
        rows = []
        for index in indices:
            differences = []
            for h in (H, 2 * H):
                ends = []
                for sign in (1, -1):
                    moved = initial[name].copy()
                    moved.reshape(-1)[index] += sign * h
                    executor.load_resident({name: moved})
                    ends.append(loss())
                differences.append((ends[0] - ends[1]) / (2 * h) if executor.is_root else None)
            rows.append((int(index), *differences))
        executor.load_resident({name: initial[name]})
        checks[name] = rows
    if not executor.is_root:
        return None
    return {"loss": base, "analytic": analytic, "differences": checks}


def evaluation(trainer: Trainer) -> dict[str, tuple[float, float]]:
    split = trainer.config.dataset
    return {"val": trainer.evaluate(split.val), "test": trainer.evaluate(split.test)}


def train_and_resume(new_executor: Factory, checkpoint: Path, resume_from: Path) -> dict:
    """An epoch with a checkpoint and the forward pass after it; then a second epoch resumed
    from `resume_from`."""
    first = Trainer(
        config(NETWORK, TRAIN_BATCH, epochs=1, checkpoint_dir=str(checkpoint)),
        executor=new_executor(),
    )
    first_losses = first.run().losses
    evaluated = evaluation(first)
    resumed = Trainer(
        config(NETWORK, TRAIN_BATCH, epochs=2, checkpoint_dir=str(resume_from), resume=True),
        executor=new_executor(),
    )
    return {
        "first_epoch": first_losses,
        "evaluation": evaluated,
        "resumed_epoch": resumed.run().losses,
    }


def mixed(executor: RankExecutor) -> dict[str, Any] | None:
    trainer = Trainer(config(MIXED, MIXED_BATCH, steps=MIXED_STEPS), executor=executor)
    executor.prepare(trainer.graph(MIXED_BATCH))
    losses = [trainer.step(step)[0] for step in range(MIXED_STEPS)]
    resident = executor.resident()
    test = trainer.evaluate(trainer.config.dataset.test)
    if not executor.is_root:
        return None
    return {"losses": losses, "resident": resident, "test": test}


def main(argv: list[str] | None = None) -> int:
    """One rank of an `mpiexec` job: `exercise` over the MPI transport."""
    parser = argparse.ArgumentParser(prog="python -m tests.conformance_driver")
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--resume-from", type=Path, required=True)
    args = parser.parse_args(argv)

    from runtime.launch import ranks_on_this_host, share_cores
    from runtime.mpi_transport import MPITransport

    share_cores(ranks_on_this_host())
    transport = MPITransport()
    try:
        result = exercise(
            lambda: RankExecutor(transport, args.strategy, seed=SEED, stall_timeout=STALL_TIMEOUT),
            args.out,
            args.resume_from,
        )
    except BaseException:  # noqa: BLE001  (every rank must end, not wait for this one)
        traceback.print_exc()
        sys.stderr.flush()
        if transport.size > 1:
            transport.abort(1)
        return 1
    if transport.rank == 0:
        (args.out / "result.pkl").write_bytes(pickle.dumps(result))
    transport.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
