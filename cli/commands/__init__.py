"""Sub-commands of the `legion-nn` CLI, one module each (see `cli.main`)."""

import argparse

#: what `--dtype` and `--optimizer` take (`legion_nn.network.DTYPES`, `legion_nn.lowering.OPTIMIZERS`,
#: named here so that parsing the command line imports neither)
DTYPES = ("float32", "float64")
OPTIMIZERS = ("sgd", "momentum", "adam")
#: what `--schedule` takes (`legion_nn.micro_batches.SCHEDULES`)
SCHEDULES = ("1f1b", "gpipe", "1f1b-deferred", "gpipe-deferred")
#: what `train --lr-schedule` takes (`runtime.lr_schedule.SCHEDULES`)
LR_SCHEDULES = ("constant", "cosine", "step")


def add_step_arguments(parser: argparse.ArgumentParser, optimizer: str = "adam") -> None:
    """`--dtype`, `--optimizer`, `--stages`, `--micro-batches` and `--schedule`: the training
    step a network lowers to (`load_step`). Their defaults are
    `train`'s, so that what `partition`, `render` and `memory` predict is the job that runs."""
    parser.add_argument(
        "--dtype", default="float32", choices=DTYPES, help="element type (default float32)"
    )
    parser.add_argument(
        "--optimizer",
        default=optimizer,
        choices=OPTIMIZERS,
        help=f"the optimizer whose update tasks and state are lowered (default {optimizer})",
    )
    parser.add_argument(
        "--stages",
        type=_stages,
        default=1,
        metavar="S",
        help="cut the layers into S pipeline stages of about equal work, each on R/S ranks, "
        "the strategy splitting each stage's layers over its ranks (default 1); auto: the "
        "stages, micro-batches and cuts of least predicted step, 1 stage included",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        metavar="M",
        help="run each step's batch as M micro-batches, the parameters' gradients added up over "
        "them (the same step; one micro-batch's activations live at a time under 1f1b): "
        "default 2·S in a pipeline, else 1",
    )
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help="the order of each pipeline stage's micro-batches: 1f1b runs S-1-s forwards ahead "
        "on stage s, then a forward and a backward in turn (default); gpipe every forward, then "
        "every backward; -deferred after either: the backwards compute input gradients only, "
        "and each stage ends computing its linear layers' weight gradients over all its "
        "micro-batches at once (with stages only)",
    )


#: `--stages auto` (`partitioner.search.stages.AUTO_STAGES`, named here so that parsing the
#: command line does not import it)
AUTO_STAGES = "auto"


def _stages(text: str) -> int | str:
    if text == AUTO_STAGES:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a count of stages or auto, not {text!r}") from None


def load_unsplit(args: argparse.Namespace, source: str, default_batch: int):
    """The training step `source` lowers to, its batch whole and in one stage."""
    from legion_nn.sources import load_source_graph

    return load_source_graph(
        source, args.batch, default_batch, dtype=args.dtype, optimizer=args.optimizer
    )


def load_step(args: argparse.Namespace, source: str, default_batch: int):
    """The training step `source` lowers to, as `add_step_arguments` parsed it: its batch run as
    micro-batches, in pipeline stages (`partitioner.pipeline`) where `--stages` asks."""
    from legion_nn.errors import LegionNNError
    from partitioner.pipeline import step_graph

    if args.stages == AUTO_STAGES:
        raise LegionNNError("--stages auto chooses stages for a count of ranks: give --ranks R")
    graph = load_unsplit(args, source, default_batch)
    stages, count, cuts = step_shape(args, graph)
    return step_graph(graph, stages, count, schedule(args, stages), cuts)


def step_shape(args: argparse.Namespace, graph) -> tuple[int, int, tuple[str, ...] | None]:
    """The stages, micro-batches and cuts of the step: `--stages` and `--micro-batches`, or the
    stages a `--strategy` file names (`partitioner.strategy_file.read_stages`), cut where it cuts them
    (None: where the FLOPs balance); `graph` is the unsplit step."""
    from legion_nn.errors import LegionNNError
    from partitioner.pipeline import cuts_naming
    from partitioner.strategy_file import read_stages

    path = getattr(args, "strategy", None) or ""
    named = read_stages(path) if path.endswith(".json") else None
    if named is None:
        return args.stages, micro_batches(args), None
    if args.stages not in (1, len(named)):
        raise LegionNNError(f"--stages {args.stages}: {path} names {len(named)} stages")
    stages = len(named)
    count = args.micro_batches or (2 * stages if stages > 1 else 1)
    return stages, count, cuts_naming(graph, named, path) if stages > 1 else None


def schedule(args: argparse.Namespace, stages: int | str) -> str | None:
    """`--schedule`, 1f1b by default (None under `--stages auto`: the search chooses); given
    where the step has one stage, one line: it orders a pipeline's stages (micro-batches alone
    run each forward, then its backward)."""
    from legion_nn.errors import LegionNNError

    if args.schedule is not None and stages == 1:
        raise LegionNNError(
            "--schedule orders the micro-batches of a pipeline's stages: give --stages S (or "
            "auto), or leave it out"
        )
    if stages == AUTO_STAGES:
        return args.schedule
    return args.schedule or SCHEDULES[0]


def load_planned(args: argparse.Namespace, source: str, default_batch: int):
    """The graph `resolve_step` plans: `load_unsplit`'s under `--stages auto` (the stages are
    chosen with the plan), else `load_step`'s."""
    if args.stages == AUTO_STAGES:
        return load_unsplit(args, source, default_batch)
    return load_step(args, source, default_batch)


def resolve_step(
    args: argparse.Namespace,
    graph,
    nranks: int,
    machine,
    model,
    note,
    time_limit: float,
    strategy: str | None = None,
):
    """The step graph and strategy the commands plan on `nranks` ranks (`strategy`, by default
    `--strategy`), auto's reasons, and the search of `--stages auto`
    (`partitioner.resolve.resolve_stages`; None otherwise): `graph` is `load_planned`'s;
    `model` a `runtime.step.model.StepModel`."""
    from partitioner.resolve import resolve_stages, resolve_strategy

    name = strategy or args.strategy
    if args.stages == AUTO_STAGES:
        return resolve_stages(
            graph,
            name,
            nranks,
            machine,
            time_limit,
            schedule(args, AUTO_STAGES),
            args.micro_batches,
            note,
            args.param_homes,
            model.peak,
            model.step,
            model.step_lower_bound,
            model.step_is_sum,
            model.share_out,
            model.compared_steps,
        )
    chosen, why = resolve_strategy(
        graph, name, nranks, machine, time_limit, note, args.param_homes, model.peak, model.step,
        model.step_lower_bound, model.step_is_sum, model.foresee, model.share_out,
    )  # fmt: skip
    return graph, chosen, why, None


def micro_batches(args: argparse.Namespace) -> int | None:
    """`--micro-batches`, by default 2·S in a pipeline of S stages and 1 without (None under
    `--stages auto`: the search chooses)."""
    if args.micro_batches is not None:
        return args.micro_batches
    if args.stages == AUTO_STAGES:
        return None
    return 2 * args.stages if args.stages > 1 else 1


#: what `--param-homes` takes (`partitioner.strategy.PARAM_HOMES`)
PARAM_HOMES = ("replicated", "sharded")


def add_stall_timeout_argument(parser: argparse.ArgumentParser) -> None:
    """`--stall-timeout S`: how long a rank waits for the others before it ends the job."""
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="end the job when a rank waits S seconds for others (default 60)",
    )


def stall_timeout(args: argparse.Namespace) -> float:
    """`--stall-timeout`, checked to be positive."""
    from legion_nn.errors import LegionNNError

    if not args.stall_timeout > 0:
        raise LegionNNError(f"--stall-timeout must be positive, got {args.stall_timeout}")
    return args.stall_timeout


def add_homes_argument(parser: argparse.ArgumentParser) -> None:
    """`--param-homes`: where parameters, their gradients and optimizer state live."""
    parser.add_argument(
        "--param-homes",
        choices=PARAM_HOMES,
        help="replicated: each rank keeps whole what its pieces read (default); sharded: every "
        "part several ranks read is cut among them, gathered just before each use and its "
        "gradient reduce-scattered (ZeRO-3)",
    )
