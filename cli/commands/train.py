"""`legion-nn train [NETWORK] ...`: train a network on digits, synthetic data or an .npz file.

With no arguments it trains `seed-lcn-small` (a locally connected network in the seed's style:
two untied filter layers, filterA, relu, a linear classifier) on scikit-learn's digits and reports
the test accuracy.

Under `mpiexec -n R` (or `mpirun`) every rank runs this command; together they run the
partitioner's plan for `--strategy` (see `runtime.distributed`), and rank 0 prints and writes the
outputs. Without a launcher it trains on one process; `--trace` then records that process's tasks.
"""

from __future__ import annotations

import argparse

from cli.commands import (
    AUTO_STAGES,
    LR_SCHEDULES,
    SCHEDULES,
    add_homes_argument,
    add_stall_timeout_argument,
    add_step_arguments,
    micro_batches,
    schedule,
    stall_timeout,
    step_shape,
)

NAME = "train"
HELP = "train a network (default: seed-lcn-small on the bundled digits) and report accuracy"
DEFAULT_NETWORK = "seed-lcn-small"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "network",
        nargs="?",
        default=DEFAULT_NETWORK,
        help=f"a built-in or a spec file (default {DEFAULT_NETWORK})",
    )
    parser.add_argument(
        "--data",
        default="digits",
        help="digits (bundled with scikit-learn), synthetic, F.npz with x, y, a directory of "
        "x_train.npy, y_train.npy (val, test optional) read in place, each rank reading its rect "
        "of each batch, or (a network of token ids) F.txt read as bytes",
    )
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, default=None, help="epochs to train (default 10)")
    length.add_argument("--steps", type=int, default=None, help="train for exactly S steps")
    parser.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    parser.add_argument(
        "--seed", type=int, default=0, help="initialisation, order and dropout seed"
    )
    add_step_arguments(parser)
    parser.add_argument(
        "--lr", type=float, default=None, help="learning rate (default: the optimizer's)"
    )
    parser.add_argument(
        "--weight-decay",
        type=float,
        default=0.0,
        metavar="W",
        help="weight decay: decoupled for adam (AdamW: p*(1-lr*W) before the step), L2 for sgd "
        "and momentum (W*p added to the gradient), as PyTorch's (default 0)",
    )
    parser.add_argument(
        "--clip-grad-norm",
        type=float,
        metavar="C",
        help="scale every gradient by min(1, C/(norm+1e-6)), the norm over all parameters on "
        "every rank together (torch.nn.utils.clip_grad_norm_)",
    )
    parser.add_argument(
        "--lr-schedule",
        default="constant",
        choices=LR_SCHEDULES,
        help="the learning rate over the run, after --warmup-steps: constant, cosine (to zero "
        "at the last step) or step (times --gamma every --step-size steps) (default constant)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        metavar="W",
        help="raise the learning rate linearly over the first W steps: lr*(t+1)/W (default 0)",
    )
    parser.add_argument(
        "--step-size", type=int, metavar="N", help="--lr-schedule step: steps between decays"
    )
    parser.add_argument(
        "--gamma",
        type=float,
        default=0.1,
        help="--lr-schedule step: the factor of each decay (default 0.1)",
    )
    parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="write DIR/checkpoint-<steps done>.npz after every epoch and at the end "
        "(DIR/checkpoint.npz links to the newest)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help="with --checkpoint: also write one every N steps",
    )
    parser.add_argument(
        "--keep",
        type=int,
        metavar="K",
        help="with --checkpoint: keep the newest K checkpoints (default 2)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in DIR, exactly as the run would have gone on",
    )
    parser.add_argument("--log-json", metavar="F", help="write one JSON record per step to F")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-evaluation",
        action="store_true",
        help="no validation at each epoch's end and no final test and train accuracy (a run "
        "that times its steps; the log's accuracy and loss fields are then null)",
    )
    parser.add_argument(
        "--save-onnx",
        metavar="F",
        help="an ONNX model's network: write it with the trained parameters to F (atomically)",
    )
    parser.add_argument(
        "--no-shuffle",
        action="store_true",
        help="take batches in order: step s is rows [s*B, (s+1)*B) of the training set",
    )
    parser.add_argument(
        "--strategy",
        default="data",
        help="under mpiexec: data, model, spatial, auto, or a grids .json file (default data)",
    )
    add_homes_argument(parser)
    parser.add_argument(
        "--machine", metavar="F", help="machine JSON for auto's cost model (see partition)"
    )
    parser.add_argument(
        "--trace", metavar="F", help="write a Chrome-trace timeline (Perfetto) of every rank to F"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check each rank's plan (coverage, producers, messages) before it runs",
    )
    add_stall_timeout_argument(parser)


def run(args: argparse.Namespace) -> int:
    from runtime.launch import rank_from_env, world_size_from_env

    if world_size_from_env() is not None:
        from runtime.supervisor import start_watcher

        return _run_rank(args, start_watcher(rank_from_env()))
    return _run_single(args)


def _config(args: argparse.Namespace):
    import numpy as np

    from legion_nn.errors import LegionNNError
    from legion_nn.micro_batches import check_micro_batches
    from legion_nn.networks import load_network
    from partitioner.machine_file import load_machine
    from partitioner.pipeline import check_stage_count
    from runtime import data
    from runtime.distributed import RunOptions, strategy_spec
    from runtime.lr_schedule import LRSchedule
    from runtime.training import TrainConfig

    if args.batch < 1:
        raise LegionNNError(f"--batch must be at least 1, got {args.batch}")
    if args.epochs is not None and args.epochs < 1:
        raise LegionNNError(f"--epochs must be at least 1, got {args.epochs}")
    if args.steps is not None and args.steps < 1:
        raise LegionNNError(f"--steps must be at least 1, got {args.steps}")
    if args.lr is not None and not args.lr > 0:
        raise LegionNNError(f"--lr must be positive, got {args.lr}")
    if not args.weight_decay >= 0:
        raise LegionNNError(f"--weight-decay must be 0 or more, got {args.weight_decay}")
    if args.clip_grad_norm is not None and not args.clip_grad_norm > 0:
        raise LegionNNError(f"--clip-grad-norm must be positive, got {args.clip_grad_norm}")
    lr_schedule = LRSchedule(args.lr_schedule, args.warmup_steps, args.step_size, args.gamma)
    timeout = stall_timeout(args)
    options = RunOptions(
        strategy=args.strategy,
        param_homes=args.param_homes,
        machine=load_machine(args.machine),
        stall_timeout=timeout,
        trace=args.trace,
        verify=args.verify,
    )
    strategy_spec(options)  # a bad --strategy fails here, on every rank alike
    network = load_network(args.network)
    stages, count, cuts = args.stages, micro_batches(args), None
    if args.stages != AUTO_STAGES:
        check_stage_count(args.stages)
        if args.strategy.endswith(".json"):
            stages, count, cuts = step_shape(args, network.lower(batch=args.batch))
    order = schedule(args, stages)
    if count is not None:  # else --stages auto chooses it
        check_micro_batches(count, args.batch, order or SCHEDULES[0])
    dataset = data.load(
        args.data,
        network.input,
        network.classes,
        args.seed,
        np.dtype(args.dtype),
        network.vocab,
    )
    config = TrainConfig(
        network=network,
        dataset=dataset,
        batch=args.batch,
        epochs=args.epochs or 10,
        steps=args.steps,
        dtype=args.dtype,
        seed=args.seed,
        optimizer=args.optimizer,
        hyperparameters=_hyperparameters(args),
        lr_schedule=lr_schedule,
        clip_grad_norm=args.clip_grad_norm,
        checkpoint_dir=args.checkpoint,
        resume=args.resume,
        checkpoint_every=args.checkpoint_every,
        **({} if args.keep is None else {"keep": args.keep}),  # default: checkpoint.KEEP
        shuffle=not args.no_shuffle,
        save_onnx=args.save_onnx,
        micro_batches=count,
        schedule=order,
        stages=stages,
        cuts=cuts,
        evaluation=not args.no_evaluation,
    )
    if args.save_onnx and not network.source.lower().endswith(".onnx"):
        raise LegionNNError(f"--save-onnx needs an ONNX model to train, not {args.network!r}")
    return config, options


def _open_log(args: argparse.Namespace):
    """The `--log-json` file (closed by the caller): a resumed run adds to its run's log, after
    a `resume` record naming the step it continues from."""
    return open(args.log_json, "a" if args.resume else "w")


def _hyperparameters(args: argparse.Namespace) -> dict[str, float]:
    """The optimizer's settings the command line changes (the rest are its defaults)."""
    out = {"lr": args.lr} if args.lr else {}
    return out | ({"weight_decay": args.weight_decay} if args.weight_decay else {})


class _Console:
    """Progress (`cli.commands.progress`) and the per-epoch lines (rank 0 only)."""

    def __init__(self, disable: bool) -> None:
        from cli.commands.progress import Progress

        self.progress = Progress(disable)
        self.evaluation = True  # the config's, told at `start`

    def on_step(self, step: int, loss: float) -> None:
        self.progress.step(loss)

    def on_epoch(self, line: str) -> None:
        self.progress.write(line)

    def start(self, config, total_steps: int, ranks: int, strategy: str) -> None:
        self.evaluation = config.evaluation
        self.progress.start(total_steps)
        where = f", {ranks} ranks, strategy {strategy}" if ranks > 1 else ""
        if config.stages == AUTO_STAGES:
            where += ", stages chosen by prediction"
        elif config.stages > 1:
            where += f" in {config.stages} stages"
        if config.micro_batches is not None and config.micro_batches > 1:
            where += f", {config.micro_batches} micro-batches ({config.schedule})"
        print(
            f"training {config.network.name} on {config.dataset.name}: "
            f"{len(config.dataset.train)} train, {len(config.dataset.val)} val, "
            f"{len(config.dataset.test)} test samples, batch {config.batch}, "
            f"{total_steps} steps, {config.optimizer}{where}",
            flush=True,
        )

    def done(self, result) -> None:
        self.progress.close()
        if not self.evaluation:
            print(f"done in {result.seconds:.2f} s (no evaluation)")
            return
        print(
            f"done in {result.seconds:.2f} s: test accuracy {result.test_accuracy:.4f}, "
            f"val accuracy {result.val_accuracy:.4f}, train accuracy {result.train_accuracy:.4f}"
        )


def _compile_ahead(
    dtype: str,
    local_rank: int,
    local_size: int,
    barrier,
    helpers: bool = True,
    alone=None,
    machine=None,
):
    """What a rank does before its first step: compile the run's kernels, its host's share of
    them among its `local_size` ranks, or alone on its host with a helper process per spare
    core (`runtime.compile_ahead`). `alone`: the `TrainConfig` of a run in one process, which
    first chooses the threads its kernels run on (`runtime.kernel_threads`, priced on
    `machine`), unless `NUMBA_NUM_THREADS` says."""

    def run(graph, prepared) -> None:
        from legion_nn.cores import spare_cores
        from runtime.compile_ahead import compile_ahead
        from runtime.compile_units import units_of
        from runtime.kernel_threads import choose_threads

        spare = spare_cores() if helpers and local_size == 1 else 0
        units = units_of(graph, getattr(prepared, "step", None))  # this rank's program
        plan = getattr(prepared, "plan", None)
        if alone is not None and plan is not None:
            steps, passes = alone.total_steps, alone.evaluation_batches
            choose_threads(graph, plan, units, steps, passes, machine, 1 + spare)
        compile_ahead(units, dtype, local_rank, local_size, barrier, spare)

    return run


def _run_single(args: argparse.Namespace) -> int:
    """One process: a one-rank run of the distributed runtime over an in-process transport."""
    import numba

    from runtime.distributed import train_rank
    from runtime.kernels.denormals import flushed_job
    from runtime.transport import ThreadTransport

    config, options = _config(args)
    log = _open_log(args) if args.log_json else None
    with flushed_job():  # before Numba's pool starts, which the next line may do
        threads = numba.get_num_threads()  # the run may choose fewer (`kernel_threads`)
        try:
            console = _Console(args.no_progress)
            console.start(config, config.total_steps, 1, options.label)
            (transport,) = ThreadTransport.group(1)
            result = train_rank(
                config,
                transport,
                options,
                None,
                log,
                console.on_step,
                console.on_epoch,
                _compile_ahead(config.dtype, 0, 1, None, alone=config, machine=options.machine),
            )
            console.done(result)
        finally:
            numba.set_num_threads(threads)
            if log is not None:
                log.close()
    return 0


def _run_rank(args: argparse.Namespace, status) -> int:
    """One rank of an mpiexec job (the child of its watcher, see `runtime.supervisor`)."""
    from cli.commands.ranks import report_setup_error, run_rank
    from legion_nn.errors import LegionNNError

    try:
        config, options = _config(args)
    except (LegionNNError, OSError) as exc:  # the same on every rank: rank 0 says it once
        return report_setup_error(NAME, exc)

    def body(transport) -> None:
        from runtime.distributed import train_rank
        from runtime.launch import local_rank_from_env, ranks_on_this_host
        from runtime.mpi_transport import idle_barrier

        root = transport.rank == 0
        log = _open_log(args) if root and args.log_json else None
        try:
            console = _Console(args.no_progress or not root)
            if root:
                console.start(config, config.total_steps, transport.size, options.label)
            local_rank = local_rank_from_env()
            ahead = (
                _compile_ahead(config.dtype, local_rank, ranks_on_this_host(), idle_barrier)
                if local_rank is not None
                else _compile_ahead(config.dtype, 0, 1, None, helpers=False)
            )
            result = train_rank(
                config, transport, options, status, log, console.on_step, console.on_epoch, ahead
            )
            if root:
                console.done(result)
        finally:
            if log is not None:
                log.close()

    return run_rank(NAME, status, body)
