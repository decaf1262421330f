"""Built-in networks and `load_network`, which takes a built-in's name or a spec file's path.

- `seed-lcn`: the locally connected network: 1×41×41 input, two untied filter layers (64
  filters 9×9, then 64 filters 7×7, each followed by filterA and a relu filterNL) and a 3034-way
  classifier.
- `seed-lcn-small`: the same structure at 1×20×20, 8 filters 5×5 then 8 filters 3×3, 10 classes.
- `three-layer-convnet`: the classic conv - relu - 2×2 max pool - affine - relu - affine - softmax
  on 3×32×32 (32 filters 7×7, 100 hidden units, 10 classes).
- `vgg19`: VGG19 at 3×224×224 with 1000 classes (the network of the bundled Chainer dump).
- `deep-mlp`: eight linear layers of 2048 with ReLU on a 2048-wide input, then a 10-way
  classifier: few large tasks, all GEMMs, the opposite of the locally connected networks (the
  cost model's benchmarks run it beside them).
- `token-mlp`: a language model of bytes (sequences of 64, vocabulary 256) without attention: an
  embedding of 64, a pre-norm residual MLP block (LayerNorm, dense 256, GELU, dense 64) and a
  dense head scoring every position's next byte.
- `byte-gpt`: a GPT-style decoder of bytes (sequences of 64, width 64, 4 heads, 2 blocks): token
  and position embeddings, pre-norm blocks of causal multi-head attention and a GELU MLP, each
  residual, a final LayerNorm and a dense head over the 256 bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from legion_nn.errors import LegionNNError
from legion_nn.layers import (
    Add,
    Conv,
    Dense,
    Dropout,
    Embedding,
    Evaluate,
    Filter,
    FilterA,
    FilterNL,
    Layer,
    LayerNorm,
    Linear,
    MatMul,
    MaxPool,
    MergeHeads,
    PositionEmbedding,
    RowSoftmax,
    Softmax,
    SplitHeads,
)
from legion_nn.layers.nonlinear import Gelu
from legion_nn.network import Network


def _lcn(name: str, input_shape, filters, classes: int) -> Network:
    layers = []
    for index, (count, window) in enumerate(filters):
        layers += [
            Filter(f"L{index}", out_channels=count, kernel=window, untied=True),
            FilterA(),
            FilterNL(fn="relu"),
        ]
    layers += [Linear("classifier", out=classes), Softmax(), Evaluate()]
    return Network(name, input_shape, classes, layers)


def seed_lcn() -> Network:
    return _lcn("seed-lcn", (1, 41, 41), [(64, 9), (64, 7)], 3034)


def seed_lcn_small() -> Network:
    return _lcn("seed-lcn-small", (1, 20, 20), [(8, 5), (8, 3)], 10)


def three_layer_convnet() -> Network:
    return Network(
        "three-layer-convnet",
        (3, 32, 32),
        10,
        [
            Conv("conv1", out_channels=32, kernel=7, pad=3),
            FilterNL(fn="relu"),
            MaxPool("pool1", kernel=2),
            Linear("fc2", out=100, bias=True),
            FilterNL(fn="relu"),
            Linear("fc3", out=10, bias=True),
            Softmax(),
            Evaluate(),
        ],
    )


VGG19_BLOCKS = [(64, 2), (128, 2), (256, 4), (512, 4), (512, 4)]


def vgg19() -> Network:
    layers = []
    for block, (channels, convs) in enumerate(VGG19_BLOCKS, start=1):
        for index in range(1, convs + 1):
            layers += [
                Conv(f"conv{block}_{index}", out_channels=channels, kernel=3, pad=1),
                FilterNL(fn="relu"),
            ]
        layers.append(MaxPool(f"pool{block}", kernel=2))
    for name in ("fc6", "fc7"):
        layers += [Linear(name, out=4096, bias=True), FilterNL(fn="relu"), Dropout(ratio=0.5)]
    layers += [Linear("fc8", out=1000, bias=True), Softmax(), Evaluate()]
    return Network("vgg19", (3, 224, 224), 1000, layers)


DEEP_MLP_WIDTH, DEEP_MLP_DEPTH = 2048, 8


def deep_mlp() -> Network:
    layers = []
    for index in range(1, DEEP_MLP_DEPTH + 1):
        layers += [Linear(f"fc{index}", out=DEEP_MLP_WIDTH), FilterNL(fn="relu")]
    layers += [Linear("classifier", out=10), Softmax(), Evaluate()]
    return Network("deep-mlp", (DEEP_MLP_WIDTH, 1, 1), 10, layers)


def token_mlp(length: int = 64, width: int = 64, vocab: int = 256) -> Network:
    """A language model of bytes without attention: each token's next is predicted from it
    alone, through a pre-norm residual MLP block (a bigram model, the transformer's parts that
    need no attention)."""
    layers = [
        Embedding("embed", vocab=vocab, dim=width),
        LayerNorm("ln1"),
        Dense("mlp_in", out=4 * width),
        Gelu("mlp_act"),
        Dense("mlp_out", out=width),
        Add("residual", inputs=["mlp_out", "embed"]),
        LayerNorm("ln_f"),
        Dense("head", out=vocab),
        Softmax("loss"),
        Evaluate(),
    ]
    return Network("token-mlp", (length,), vocab, layers)


def gpt_block(block: str, before: str, width: int, heads: int) -> list[Layer]:
    """One pre-norm GPT block reading group `before`: causal multi-head attention, then an MLP
    of 4·width, each added back to its input."""
    size = width // heads

    def name(part: str) -> str:
        return f"{block}_{part}"

    return [
        LayerNorm(name("ln1"), inputs=[before]),
        # a key's bias adds q·b to every score of a row, which the softmax cancels
        *(Dense(name(p), out=width, bias=p != "k", inputs=[name("ln1")]) for p in "qkv"),
        *(SplitHeads(name(f"{p}h"), heads=heads, inputs=[name(p)]) for p in "qkv"),
        MatMul(name("scores"), inputs=[name("qh"), name("kh")], transpose_b=True,
               scale=1 / math.sqrt(size)),
        RowSoftmax(name("attn"), causal=True),
        MatMul(name("context"), inputs=[name("attn"), name("vh")]),
        MergeHeads(name("merge")),
        Dense(name("proj"), out=width),
        Add(name("res1"), inputs=[name("proj"), before]),
        LayerNorm(name("ln2")),
        Dense(name("fc"), out=4 * width),
        Gelu(name("gelu")),
        Dense(name("fc_out"), out=width),
        Add(name("res2"), inputs=[name("fc_out"), name("res1")]),
    ]  # fmt: skip


def gpt(
    length: int = 64, width: int = 64, heads: int = 4, blocks: int = 2, vocab: int = 256
) -> Network:
    """A GPT-style decoder of bytes: token and position embeddings, `blocks` pre-norm blocks
    of causal attention and MLP, a final LayerNorm and a dense head."""
    layers: list[Layer] = [
        Embedding("tok", vocab=vocab, dim=width),
        PositionEmbedding("pos"),
    ]
    for index in range(blocks):
        layers += gpt_block(f"b{index}", layers[-1].name, width, heads)
    layers += [LayerNorm("ln_f"), Dense("head", out=vocab), Softmax("loss"), Evaluate()]
    return Network("byte-gpt", (length,), vocab, layers)


BUILTINS: dict[str, Callable[[], Network]] = {
    "seed-lcn": seed_lcn,
    "seed-lcn-small": seed_lcn_small,
    "three-layer-convnet": three_layer_convnet,
    "vgg19": vgg19,
    "deep-mlp": deep_mlp,
    "token-mlp": token_mlp,
    "byte-gpt": gpt,
}


def load_network(name_or_path: str) -> Network:
    """A built-in by name, an ONNX model (`.onnx`) or a JSON/TOML spec file by path."""
    if name_or_path in BUILTINS:
        return BUILTINS[name_or_path]()
    path = Path(name_or_path)
    if is_onnx(path):
        from legion_nn.importers.onnx_model import load_onnx

        return load_onnx(path)
    if path.suffix.lower() in (".json", ".toml") or path.exists():
        from legion_nn.spec import load_spec

        return load_spec(path)
    raise LegionNNError(
        f"unknown network {name_or_path!r}: not a built-in ({', '.join(BUILTINS)}) nor a spec file"
    )


def is_onnx(path: Path) -> bool:
    return path.suffix.lower() == ".onnx"
