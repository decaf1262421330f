"""Sub-commands of the `legion-nn` CLI, one module each (see `legion_nn.cli`)."""

import argparse

#: what `--dtype` and `--optimizer` take (`legion_nn.network.DTYPES`, `legion_nn.lowering.OPTIMIZERS`,
#: named here so that parsing the command line imports neither)
DTYPES = ("float32", "float64")
OPTIMIZERS = ("sgd", "momentum", "adam")


def add_step_arguments(parser: argparse.ArgumentParser, optimizer: str = "adam") -> None:
    """`--dtype` and `--optimizer`: the training step a network lowers to. Their defaults are
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
