"""`legion-nn train [NETWORK] ...`: train a network on digits, synthetic data or an .npz file.

With no arguments it trains `seed-lcn-small` (a locally connected network in the seed's style:
two untied filter layers, filterA, relu, a linear classifier) on scikit-learn's digits and reports
the test accuracy.
"""

from __future__ import annotations

import argparse
import sys

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
        help="digits (bundled with scikit-learn), synthetic, or F.npz with x, y",
    )
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, default=None, help="epochs to train (default 10)")
    length.add_argument("--steps", type=int, default=None, help="train for exactly S steps")
    parser.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument(
        "--seed", type=int, default=0, help="initialisation, order and dropout seed"
    )
    parser.add_argument("--optimizer", default="adam", choices=("sgd", "momentum", "adam"))
    parser.add_argument(
        "--lr", type=float, default=None, help="learning rate (default: the optimizer's)"
    )
    parser.add_argument(
        "--checkpoint", metavar="DIR", help="write DIR/checkpoint.npz after every epoch"
    )
    parser.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.npz")
    parser.add_argument("--log-json", metavar="F", help="write one JSON record per step to F")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from legion_nn.errors import LegionNNError
    from legion_nn.networks import load_network
    from runtime import data
    from runtime.executor import NUMPY_DTYPES
    from runtime.training import TrainConfig, Trainer

    if args.batch < 1:
        raise LegionNNError(f"--batch must be at least 1, got {args.batch}")
    if args.epochs is not None and args.epochs < 1:
        raise LegionNNError(f"--epochs must be at least 1, got {args.epochs}")
    if args.steps is not None and args.steps < 1:
        raise LegionNNError(f"--steps must be at least 1, got {args.steps}")
    if args.lr is not None and not args.lr > 0:
        raise LegionNNError(f"--lr must be positive, got {args.lr}")
    network = load_network(args.network)
    dataset = data.load(
        args.data, network.input, network.classes, args.seed, NUMPY_DTYPES[args.dtype]
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
        hyperparameters={"lr": args.lr} if args.lr else {},
        checkpoint_dir=args.checkpoint,
        resume=args.resume,
    )
    log = open(args.log_json, "w") if args.log_json else None  # noqa: SIM115  (a stream, closed below)
    try:
        bar = tqdm(total=None, disable=args.no_progress, unit="step", file=sys.stderr)
        trainer = Trainer(
            config,
            log=log,
            on_step=lambda step, loss: (bar.update(1), bar.set_postfix(loss=f"{loss:.4f}")),
            on_epoch=lambda line: bar.write(line, file=sys.stdout),
        )
        bar.total = trainer.total_steps
        print(
            f"training {network.name} on {dataset.name}: {len(dataset.train)} train, "
            f"{len(dataset.val)} val, {len(dataset.test)} test samples, batch {args.batch}, "
            f"{trainer.total_steps} steps, {args.optimizer}"
        )
        result = trainer.run()
        bar.close()
    finally:
        if log is not None:
            log.close()
    print(
        f"done in {result.seconds:.1f} s: test accuracy {result.test_accuracy:.4f}, "
        f"val accuracy {result.val_accuracy:.4f}, train accuracy {result.train_accuracy:.4f}"
    )
    return 0
