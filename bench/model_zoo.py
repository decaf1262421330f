"""Benchmark and check: ONNX's own model-zoo test set, each model as a user runs it.

    python bench/model_zoo.py [--models alexnet,resnet50] [--skip mpi,plans,speed] [--ranks 64]

For each model of `onnx/backend/test/data/light/` (shipped with the `onnx` package):

- `predict` on the set's input (`arange(n).reshape(shape) / n`, float32) in one process and
  under `mpiexec -n 2` with the model and spatial splits, against `light_<name>_output_0.pb`
  within onnxruntime's tolerance for the set (rtol 1e-3, atol 1e-5);
- `partition` on 8 ranks under data, model, spatial and auto (the predicted steps, and whether
  auto is predicted no slower than the best fixed one), and the wall time of
  `partition --json` on `--ranks` ranks (data and auto);
- `train --steps 2` on synthetic data;
- the forward pass of ResNet-50 at batch 8 and 1 and of VGG-19 at batch 1 (`SPEED_CASES`), as
  `predict` runs it, against onnxruntime's session on the same input, on this machine, as a
  ratio, with NumPy's SGEMM beside it (the machine is shared and its speed moves).

Each command runs as a user runs it, in a child process; the table prints as the rows finish.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.kernels import sgemm_gflops
from bench.machine_facts import describe, machine_facts

MODELS = (
    "bvlc_alexnet",
    "densenet121",
    "inception_v1",
    "inception_v2",
    "resnet50",
    "shufflenet",
    "squeezenet",
    "vgg19",
    "zfnet512",
)
STRATEGIES = ("data", "model", "spatial", "auto")
RTOL, ATOL = 1e-3, 1e-5
#: how long a `partition --json` on `--ranks` ranks may take before the table says so
PARTITION_LIMIT_S = 60.0


def light() -> Path:
    import onnx

    return Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def reference(name: str) -> tuple[np.ndarray, np.ndarray]:
    """The set's input and expected output for model `name`."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(light() / f"light_{name}.onnx"), load_external_data=False)
    stored = {t.name for t in model.graph.initializer}
    (value,) = [v for v in model.graph.input if v.name not in stored]
    shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
    count = int(np.prod(shape))
    x = (np.arange(count).reshape(shape) / count).astype(np.float32)
    expected = numpy_helper.to_array(onnx.load_tensor(str(light() / f"light_{name}_output_0.pb")))
    return x, expected


def cli(
    *args: str, mpi: int | None = None, timeout: float | None = None
) -> tuple[float, subprocess.CompletedProcess | None]:
    """The command's wall seconds and its result (None where it ran past `timeout`)."""
    launcher = ["mpiexec", "-n", str(mpi)] if mpi else []
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [*launcher, sys.executable, "-m", "cli", *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        done = None
    return time.perf_counter() - start, done


def predicted(name: str, tmp: Path, mpi: int | None = None, strategy: str = "data") -> str:
    """'ok' with the largest error, or what failed."""
    x, expected = reference(name)
    data, out = tmp / f"{name}_x.npz", tmp / f"{name}_{strategy}_{mpi}.npz"
    np.savez(data, x=x)
    seconds, done = cli(
        "predict", str(light() / f"light_{name}.onnx"), "--data", str(data), "--output",
        str(out), "--strategy", strategy, mpi=mpi,
    )  # fmt: skip
    if done.returncode != 0:
        return f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1][:70]}"
    got = np.load(out)["y"].reshape(expected.shape)
    error = np.abs(got - expected).max()
    ok = np.allclose(got, expected, rtol=RTOL, atol=ATOL)
    return f"{'ok' if ok else 'FAIL'} {error:.1e} ({seconds:.0f} s)"


def plans(name: str, tmp: Path, ranks: int) -> str:
    model = str(light() / f"light_{name}.onnx")
    steps = {}
    for strategy in STRATEGIES:
        out = tmp / f"{name}_{strategy}.json"
        _, done = cli("partition", model, "--ranks", "8", "--strategy", strategy, "--batch", "8",
                      "--json", str(out))  # fmt: skip
        if done.returncode != 0:
            return f"{strategy}: {done.stderr.strip()[:70]}"
        steps[strategy] = json.loads(out.read_text())["predicted_step_seconds"]
    best = min(steps[s] for s in STRATEGIES[:-1])
    walls = []
    for strategy in ("data", "auto"):
        wall, done = cli("partition", model, "--ranks", str(ranks), "--strategy", strategy,
                         "--batch", "64", "--json", str(tmp / "big.json"),
                         timeout=PARTITION_LIMIT_S)  # fmt: skip
        if done is None:
            walls.append(f">{PARTITION_LIMIT_S:.0f}")
            continue
        model_used = json.loads((tmp / "big.json").read_text())["step_model"][:4]
        walls.append(f"{wall:.1f} ({model_used})" if done.returncode == 0 else "fail")
    shown = " ".join(f"{s[0]}{steps[s] * 1e3:.0f}" for s in STRATEGIES)
    verdict = "auto<=best" if steps["auto"] <= best * (1 + 1e-9) else "AUTO SLOWER"
    return f"{shown} ms, {verdict}; {ranks} ranks: {'/'.join(walls)} s"


def trains(name: str, tmp: Path) -> str:
    """`train --steps 2` in one process, on 4 random samples of the model's shape (so that
    the end of the epoch evaluates 4 samples, not a synthetic set of a thousand)."""
    x, _ = reference(name)
    rng = np.random.default_rng(0)
    data = tmp / f"{name}_train.npz"
    samples = rng.standard_normal((4, *x.shape[1:])).astype(np.float32)
    np.savez(data, x_train=samples, y_train=rng.integers(0, 1000, 4))
    seconds, done = cli("train", str(light() / f"light_{name}.onnx"), "--data", str(data),
                        "--steps", "2", "--batch", "2", "--no-progress")  # fmt: skip
    if done.returncode != 0:
        return f"exit {done.returncode}: {done.stderr.strip()[:70]}"
    return f"ok ({seconds:.0f} s)"


def batched(path: Path, batch: int, tmp: Path) -> Path:
    """The set's model, made for batch 1, with `batch` in place of its input's, its output's and
    its Reshape targets' first dim, written to `tmp`."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    stored = {t.name: i for i, t in enumerate(graph.initializer)}
    for value in (*graph.input, *graph.output):
        dims = value.type.tensor_type.shape.dim
        if value.name not in stored and dims:
            dims[0].dim_value = batch
    for node in graph.node:
        if node.op_type == "Reshape" and node.input[1] in stored:
            index = stored[node.input[1]]
            target = numpy_helper.to_array(graph.initializer[index]).copy()
            target[0] = batch
            graph.initializer[index].CopyFrom(numpy_helper.from_array(target, node.input[1]))
    out = tmp / f"batch{batch}_{path.name}"
    onnx.save(model, str(out))
    return out


#: (model, batch, its forward's multiply-adds a sample) of `speed`: ResNet-50 at batch 8, and
#: at batch 1, as a user predicts one image (one example's products run along its positions)
SPEED_CASES = (("resnet50", 8, 4.1e9), ("resnet50", 1, 4.1e9), ("vgg19", 1, 19.6e9))


def speed(tmp: Path, repeat: int = 5) -> None:
    """Each of `SPEED_CASES`: legion-nn's forward pass (as `predict` runs each batch, planned
    and compiled before) against onnxruntime's session, in one process."""
    for name, batch, macs in SPEED_CASES:
        a, b = _forward_seconds(light() / f"light_{name}.onnx", batch, tmp, repeat)
        flops = 2 * macs * batch
        print(
            f"{name} forward, batch {batch}, median of {repeat}: legion-nn {a:.3f} s "
            f"({flops / a / 1e9:.0f} GFLOP/s), onnxruntime {b:.3f} s ({flops / b / 1e9:.0f} "
            f"GFLOP/s); ratio {a / b:.2f}",
            flush=True,
        )


def _forward_seconds(model: Path, batch: int, tmp: Path, repeat: int) -> tuple[float, float]:
    """The median seconds of `model`'s forward at `batch`: legion-nn's, onnxruntime's."""
    import onnxruntime as ort

    from legion_nn.importers.onnx_model import load_onnx
    from runtime.prediction import Predictor
    from runtime.transport import ThreadTransport

    path = batched(model, batch, tmp)
    x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224)).astype(np.float32)
    (transport,) = ThreadTransport.group(1)
    predictor = Predictor(load_onnx(path), batch, transport, "data")

    def ours() -> None:
        predictor.run(x)

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x}

    def theirs() -> None:
        session.run(None, feed)

    times = {ours: [], theirs: []}
    for run in (ours, theirs):
        run()  # compiled, warmed
    for _ in range(repeat):  # alternated, so that both see the same minutes of a shared machine
        for run in (ours, theirs):
            tic = time.perf_counter()
            run()
            times[run].append(time.perf_counter() - tic)
    return float(np.median(times[ours])), float(np.median(times[theirs]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--skip", default="", help="any of: mpi, plans, train, speed")
    parser.add_argument("--ranks", type=int, default=64)
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    skip = set(args.skip.split(",")) - {""}
    if set(names) - set(MODELS) or skip - {"mpi", "plans", "train", "speed"}:
        print("model_zoo: unknown model or part", file=sys.stderr)
        return 2
    print(describe(machine_facts()))
    print(f"SGEMM {sgemm_gflops():.0f} GFLOP/s")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for name in names:
            row = [f"{name:13}", f"one process: {predicted(name, tmp)}"]
            if "mpi" not in skip:
                for strategy in ("model", "spatial"):
                    row.append(f"mpiexec -n 2 {strategy}: {predicted(name, tmp, 2, strategy)}")
            if "plans" not in skip:
                row.append(f"plans: {plans(name, tmp, args.ranks)}")
            if "train" not in skip:
                row.append(f"train --steps 2: {trains(name, tmp)}")
            print(" | ".join(row), flush=True)
        if "speed" not in skip:
            speed(tmp)
    print(f"SGEMM after: {sgemm_gflops():.0f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
