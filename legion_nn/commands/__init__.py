"""Sub-commands of the `legion-nn` CLI, one module each (see `legion_nn.cli`)."""

import argparse

#: what `--dtype` and `--optimizer` take (`legion_nn.network.DTYPES`, `legion_nn.lowering.OPTIMIZERS`,
#: named here so that parsing the command line imports neither)
DTYPES = ("float32", "float64")
OPTIMIZERS = ("sgd", "momentum", "adam")
#: what `--schedule` takes (`legion_nn.micro_batches.SCHEDULES`)
SCHEDULES = ("1f1b", "gpipe")


def add_step_arguments(parser: argparse.ArgumentParser, optimizer: str = "adam") -> None:
    """`--dtype`, `--optimizer`, `--micro-batches` and `--schedule`: the training step a
    network lowers to. Their defaults are
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
        "--micro-batches",
        type=int,
        default=1,
        metavar="M",
        help="run each step's batch as M micro-batches, the parameters' gradients added up over "
        "them: the same step, with one micro-batch's activations live at a time under 1f1b "
        "(default 1)",
    )
    parser.add_argument(
        "--schedule",
        default="1f1b",
        choices=SCHEDULES,
        help="the order of the micro-batches' forwards and backwards: 1f1b runs each backward "
        "right after its forward (default), gpipe every forward, then every backward",
    )


def step_options(args: argparse.Namespace) -> dict:
    """What `add_step_arguments` parsed, as `legion_nn.sources.load_source_graph` takes it."""
    return {
        "dtype": args.dtype,
        "optimizer": args.optimizer,
        "micro_batches": args.micro_batches,
        "schedule": args.schedule,
    }


#: what `--param-homes` takes (`partitioner.strategy.PARAM_HOMES`)
PARAM_HOMES = ("replicated", "sharded")


def add_homes_argument(parser: argparse.ArgumentParser) -> None:
    """`--param-homes`: where parameters, their gradients and optimizer state live."""
    parser.add_argument(
        "--param-homes",
        choices=PARAM_HOMES,
        help="replicated: each rank keeps whole what its pieces read (default); sharded: every "
        "part several ranks read is cut among them, gathered just before each use and its "
        "gradient reduce-scattered (ZeRO-3)",
    )
