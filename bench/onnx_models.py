"""Benchmark: torchvision's models as ONNX: import, plan at scale, and count FLOPs against PyTorch.

    pip install torch torchvision && python bench/onnx_models.py [--models vgg11] [--batch 256]
        [--ranks 64,1024] [--json F]

For each model: exported by PyTorch (opset 17, dynamic batch, untrained), read by legion-nn
(`legion_nn.importers.onnx_model`), planned under data, model, spatial and auto at each rank
count (seconds of CPU for the search and the plan, as `bench/planning.py` times them, and the
predicted step on the default machine), and its step's FLOPs, forward plus backward, against
PyTorch's `FlopCounterMode` on the same batch (which counts the matrix products and
convolutions: legion-nn's count of those ops' tasks, and of every task, are both shown).

resnet18's residual Adds make its graph a DAG: `auto` plans it by the DP over each row's
dependencies (`partitioner/search/auto.py`); its search alone is shown as `search`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from legion_nn.errors import LegionNNError
from legion_nn.importers.onnx_model import load_onnx
from partitioner.accounting import flops_per_rank
from partitioner.cost import plan_cost
from partitioner.machine import Machine
from partitioner.plan import build_plan
from partitioner.search.auto import auto
from partitioner.strategy import builtin

PRODUCTS = ("conv", "linear")


def export(name: str, path: Path) -> None:
    import torch
    import torchvision

    model = getattr(torchvision.models, name)(weights=None).eval()
    torch.onnx.export(
        model,
        (torch.zeros(1, 3, 224, 224),),
        str(path),
        input_names=["x"],
        output_names=["logits"],
        dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )


def torch_flops(name: str, batch: int) -> int:
    """PyTorch's count of one training step's forward and backward FLOPs."""
    import torch
    import torchvision
    from torch.utils.flop_counter import FlopCounterMode

    model = getattr(torchvision.models, name)(weights=None)
    x = torch.randn(batch, 3, 224, 224)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="vgg11,resnet18")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--ranks", default="64,1024")
    parser.add_argument("--json", metavar="F")
    args = parser.parse_args(argv)
    machine = Machine()
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = Path(tmp) / f"{name}.onnx"
            export(name, path)
            try:
                network = load_onnx(path)
            except LegionNNError as exc:
                print(f"{name}: refused: {exc}")
                out[name] = {"refused": str(exc)}
                continue
            graph = network.lower(batch=args.batch)
            row: dict = {"plans": []}
            for ranks in (int(r) for r in args.ranks.split(",")):
                for strategy in ("data", "model", "spatial", "auto"):
                    started = time.process_time()
                    chosen = (
                        auto(graph, ranks, machine).strategy
                        if strategy == "auto"
                        else builtin(graph, strategy, ranks)
                    )
                    search = time.process_time() - started
                    plan = build_plan(graph, chosen, ranks)
                    cost = plan_cost(graph, plan, machine)
                    seconds = time.process_time() - started
                    row["plans"].append(
                        {"ranks": ranks, "strategy": strategy, "cpu_s": seconds,
                         "search_cpu_s": search, "step_s": cost.step_seconds}
                    )  # fmt: skip
                    print(
                        f"{name} {ranks:5d} ranks {strategy:8s} planned in {seconds:6.2f} s CPU"
                        f" (search {search:5.2f} s), step {cost.step_seconds:.4f} s"
                    )
                    if ranks == int(args.ranks.split(",")[0]) and strategy == "data":
                        per_task = flops_per_rank(graph, plan)
                        passes = [
                            (t, f.sum())
                            for t, f in zip(graph.tasks, per_task)
                            if t.phase in ("forward", "backward")
                        ]
                        row["flops_all"] = float(sum(f for _, f in passes))
                        row["flops_products"] = float(sum(f for t, f in passes if t.op in PRODUCTS))
            row["torch_flops"] = torch_flops(name, args.batch)
            for key in ("flops_products", "flops_all"):
                ratio = row[key] / row["torch_flops"]
                print(f"{name}: {key} {row[key] / 1e12:.3f} TFLOP, {ratio:.4f}x PyTorch's")
            out[name] = row
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
