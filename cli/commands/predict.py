"""`legion-nn predict MODEL --data F.npz --output F.npz`: the forward pass over new data.

The model is anything `train` takes (an ONNX model, a spec file, a built-in). Its parameters are
its own (an ONNX model's initializers) or, with `--checkpoint DIR`, those of a checkpoint that
`train --checkpoint DIR` wrote for it. `--data` holds the samples under `x` or under the model's
input name (an ONNX graph's input), each of the model's per-sample shape; token ids are
integers. The output file holds the model's outputs for them, before any loss appended to
train it, under the model's output name (an ONNX graph's output) and under `y`, written
atomically by rank 0.

Under `mpiexec -n R` every rank runs the command and the batches run on the plan of
`--strategy` (`runtime.prediction`); without a launcher it runs in one process.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cli.commands import DTYPES, add_stall_timeout_argument, stall_timeout

NAME = "predict"
HELP = "run a model's forward pass over the samples of an .npz file and write its outputs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="an ONNX model, a spec file or a built-in")
    parser.add_argument("--data", required=True, metavar="F.npz", help="the samples, as x")
    parser.add_argument("--output", required=True, metavar="F.npz", help="where to write them")
    parser.add_argument("--batch", type=int, default=32, help="samples per pass (default 32)")
    parser.add_argument(
        "--strategy",
        default="data",
        help="under mpiexec: data, model, spatial, auto, or a grids .json file (default data)",
    )
    parser.add_argument(
        "--checkpoint", metavar="DIR", help="take the parameters of the newest checkpoint in DIR"
    )
    parser.add_argument(
        "--dtype", default="float32", choices=DTYPES, help="element type (default float32)"
    )
    parser.add_argument(
        "--machine", metavar="F", help="machine JSON for auto's cost model (see partition)"
    )
    add_stall_timeout_argument(parser)


def run(args: argparse.Namespace) -> int:
    from runtime.launch import rank_from_env, world_size_from_env

    if world_size_from_env() is None:
        from runtime.kernels.denormals import flushed_job
        from runtime.transport import ThreadTransport

        with flushed_job():  # before Numba's pool starts
            job = _job(args)
            (transport,) = ThreadTransport.group(1)
            _predict(args, job, transport)
        return 0
    from cli.commands.ranks import report_setup_error, run_rank
    from legion_nn.errors import LegionNNError
    from runtime.supervisor import start_watcher

    status = start_watcher(rank_from_env())
    try:
        job = _job(args)
    except (LegionNNError, OSError) as exc:  # the same on every rank: rank 0 says it once
        return report_setup_error(NAME, exc)
    return run_rank(NAME, status, lambda transport: _predict(args, job, transport))


def _job(args: argparse.Namespace):
    """(network, samples, parameters, machine, strategy), every input checked: a bad one is a
    `LegionNNError` naming its file, key or flag, before anything runs or is written."""
    from legion_nn.errors import LegionNNError
    from legion_nn.networks import load_network
    from partitioner.machine_file import load_machine
    from runtime.distributed import RunOptions, strategy_spec

    if args.batch < 1:
        raise LegionNNError(f"--batch must be at least 1, got {args.batch}")
    stall_timeout(args)
    folder = Path(args.output).parent
    if not folder.is_dir():  # found now, not after every batch has run
        raise LegionNNError(f"--output {args.output}: no directory {str(folder)!r} to write it in")
    machine = load_machine(args.machine)
    strategy = strategy_spec(RunOptions(strategy=args.strategy, machine=machine))
    network = load_network(args.model)
    x = _samples(args.data, network, args.dtype)
    parameters = _checkpoint(args.checkpoint, network) if args.checkpoint else None
    return network, x, parameters, machine, strategy


def _samples(path: str, network, dtype: str):
    """The samples of `path` under `x` or the model's input name, of the model's shape."""
    import zipfile

    import numpy as np

    from legion_nn.errors import LegionNNError, read_input

    read_input(path, binary=True)  # a missing or unreadable file: one line naming it
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise LegionNNError(f"{path}: not an .npz file ({exc})") from None
    names = [n for n in dict.fromkeys(("x", network.input_name)) if n in arrays]
    if not names:
        raise LegionNNError(
            f"{path}: no samples under 'x' or {network.input_name!r} (the model's input); "
            f"it holds {', '.join(sorted(arrays)) or 'nothing'}"
        )
    x = arrays[names[0]]
    if x.ndim != 1 + len(network.input) or tuple(x.shape[1:]) != tuple(network.input):
        raise LegionNNError(
            f"{path}: {names[0]} has shape {list(x.shape)}; the model takes "
            f"[samples, {', '.join(str(d) for d in network.input)}]"
        )
    if len(x) == 0:
        raise LegionNNError(f"{path}: {names[0]} holds no samples")
    if network.vocab:
        if not np.issubdtype(x.dtype, np.integer):
            raise LegionNNError(f"{path}: {names[0]} must hold token ids (integers), not {x.dtype}")
        if x.min() < 0 or x.max() >= network.vocab:
            raise LegionNNError(
                f"{path}: {names[0]} holds ids outside [0, {network.vocab}) (the vocabulary)"
            )
        return x.astype(np.int32)
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise LegionNNError(f"{path}: {names[0]} must hold numbers, not {x.dtype}")
    return x.astype(dtype)


def _checkpoint(directory: str, network):
    """The parameters and state of the newest checkpoint in `DIR`, checked to be this network's."""
    from runtime import checkpoint
    from runtime.training import fingerprint

    arrays, _ = checkpoint.load(
        directory, {"network": network.name, "fingerprint": fingerprint(network)}
    )
    return arrays


def _predict(args: argparse.Namespace, job, transport) -> None:
    import numpy as np

    from legion_nn.atomic import atomic_write
    from runtime.prediction import Predictor

    network, x, parameters, machine, strategy = job
    batch = min(args.batch, len(x))
    y = Predictor(
        network, batch, transport, strategy, args.dtype, parameters, machine, args.stall_timeout
    ).outputs(x)
    if y is None:
        return
    if network.output_shape:
        y = y.reshape(len(x), *network.output_shape)
    outputs = {"y": y} | ({network.output_name: y} if network.output_name != "y" else {})
    with atomic_write(args.output, "wb") as handle:
        np.savez(handle, **outputs)
    where = f" on {transport.size} ranks ({args.strategy})" if transport.size > 1 else ""
    print(f"predicted {len(x)} samples{where}: {list(y.shape)} written to {args.output}")
