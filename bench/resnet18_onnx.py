"""Make torchvision's ResNet-18 as an ONNX file, without PyTorch: the graph built by `onnx.helper`.

    python bench/resnet18_onnx.py OUT.onnx [--size 64] [--classes 1000] [--seed 0] [--check]

The graph is torchvision's `resnet18` as `torch.onnx.export` writes it in eval mode (opset 17),
BatchNormalization left unfused: conv1 7×7 stride 2 pad 3 → bn → relu → maxpool 3×3 stride 2
pad 1 → four stages of two BasicBlocks (64, 128, 256, 512 channels; the first block of stages 2-4
strides by 2, and its shortcut is a 1×1 stride-2 conv + bn) → GlobalAveragePool → Flatten → Gemm
to the classes. A BasicBlock is conv 3×3 → bn → relu → conv 3×3 → bn, added to its shortcut,
then relu. Initializers are seeded random (He-scaled convolutions, unit-ish batch norms), so the
file is reproducible; it is untrained. The input is `input` of shape [N, 3, SIZE, SIZE] with a
symbolic batch dim, the output `logits` [N, CLASSES].

Timings of the planner and its predictions use it at 64×64 (`legion-nn partition OUT.onnx --batch
64 --ranks 64`), where torchvision cannot be installed. `--check` runs a forward pass of 2 samples
through onnxruntime (if installed) and legion-nn, and fails where the probabilities differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: (channels, stride of the stage's first block)
STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))


class _Graph:
    """Nodes and initializers as they are added, named as torchvision's modules are."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.initializers: list = []

    def constant(self, name: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(value.astype(np.float32), name))
        return name

    def conv(self, x: str, name: str, cin: int, cout: int, kernel: int, stride: int) -> str:
        from onnx import helper

        fan_in = cin * kernel * kernel
        weight = self.rng.standard_normal((cout, cin, kernel, kernel)) * np.sqrt(2.0 / fan_in)
        pad = kernel // 2
        self.nodes.append(
            helper.make_node(
                "Conv",
                [x, self.constant(f"{name}.weight", weight)],
                [name],
                name=name,
                kernel_shape=[kernel, kernel],
                strides=[stride, stride],
                pads=[pad] * 4,
            )
        )
        return name

    def bn(self, x: str, name: str, channels: int) -> str:
        from onnx import helper

        inputs = [
            x,
            self.constant(f"{name}.weight", 1 + 0.1 * self.rng.standard_normal(channels)),
            self.constant(f"{name}.bias", 0.1 * self.rng.standard_normal(channels)),
            self.constant(f"{name}.running_mean", 0.1 * self.rng.standard_normal(channels)),
            self.constant(f"{name}.running_var", 1 + 0.1 * self.rng.random(channels)),
        ]
        self.nodes.append(
            helper.make_node("BatchNormalization", inputs, [name], name=name, epsilon=1e-5)
        )
        return name

    def op(self, op: str, inputs: list[str], name: str, **attrs) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def block(self, x: str, name: str, cin: int, cout: int, stride: int) -> str:
        """A BasicBlock: two 3×3 convs with batch norms, added to the shortcut, then relu."""
        out = self.conv(x, f"{name}.conv1", cin, cout, 3, stride)
        out = self.op("Relu", [self.bn(out, f"{name}.bn1", cout)], f"{name}.relu1")
        out = self.bn(self.conv(out, f"{name}.conv2", cout, cout, 3, 1), f"{name}.bn2", cout)
        shortcut = x
        if stride != 1 or cin != cout:
            shortcut = self.conv(x, f"{name}.downsample.0", cin, cout, 1, stride)
            shortcut = self.bn(shortcut, f"{name}.downsample.1", cout)
        return self.op("Relu", [self.op("Add", [out, shortcut], f"{name}.add")], f"{name}.relu2")


def resnet18(size: int = 64, classes: int = 1000, seed: int = 0):
    """The ONNX model (see the module docstring)."""
    import onnx
    from onnx import TensorProto, helper

    g = _Graph(seed)
    x = g.op("Relu", [g.bn(g.conv("input", "conv1", 3, 64, 7, 2), "bn1", 64)], "relu")
    x = g.op("MaxPool", [x], "maxpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, (channels, stride) in enumerate(STAGES, start=1):
        x = g.block(x, f"layer{stage}.0", cin, channels, stride)
        x = g.block(x, f"layer{stage}.1", channels, channels, 1)
        cin = channels
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x], "avgpool")], "flatten", axis=1)
    weight = g.rng.standard_normal((classes, cin)) / np.sqrt(cin)
    g.op(
        "Gemm",
        [x, g.constant("fc.weight", weight), g.constant("fc.bias", np.zeros(classes))],
        "logits",
        transB=1,
    )
    graph = helper.make_graph(
        g.nodes,
        "resnet18",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])],
        g.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def check(path: Path) -> float | None:
    """The largest difference of legion-nn's class probabilities from onnxruntime's on 2 random
    samples, or None without onnxruntime."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    from legion_nn.networks import load_network
    from runtime.adapters import StepContext
    from runtime.rank_executor import one_process

    network = load_network(str(path))
    x = np.random.default_rng(1).standard_normal((2, *network.input)).astype(np.float32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"input": x})
    logits = logits.astype(np.float64)
    expected = np.exp(logits - logits.max(axis=1, keepdims=True))
    expected /= expected.sum(axis=1, keepdims=True)

    graph = network.lower(batch=len(x), dtype="float64")
    executor = one_process(0)
    executor.prepare(graph, network.initial)
    context = StepContext(
        0, training=False, inputs=x.astype(np.float64), labels=np.zeros(2, np.int32)
    )
    executor.run_inference(graph, context)
    name = next(t for t in graph.tensors if t.endswith(".probability"))
    got = executor.value(name).reshape(len(x), -1)
    return float(np.abs(got - expected).max())


def main(argv: list[str] | None = None) -> int:
    import onnx

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the .onnx file to write")
    parser.add_argument("--size", type=int, default=64, help="input height and width (64)")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare with onnxruntime")
    args = parser.parse_args(argv)
    path = Path(args.out)
    onnx.save(resnet18(args.size, args.classes, args.seed), path)
    print(f"wrote {path}")
    if args.check:
        difference = check(path)
        if difference is None:
            print("onnxruntime is not installed: forward pass not compared")
        else:
            print(f"largest difference of the probabilities from onnxruntime's: {difference:.2e}")
            if difference > 1e-4:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
