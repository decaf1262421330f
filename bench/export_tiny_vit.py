"""Make `tests/fixtures/tiny_vit.onnx`: a vision transformer built and exported by PyTorch.

    pip install torch && python bench/export_tiny_vit.py [--out tests/fixtures/tiny_vit.onnx]

The model, as a user writes one: 3×16×16 images cut into 4×4 patches by a strided `nn.Conv2d`
(width 32), flattened and transposed into 16 tokens, a learned class token prepended, a learned
position embedding added, 2 pre-norm blocks of (non-causal) multi-head attention (4 heads) and a
GELU MLP, `nn.LayerNorm`, and a head over 10 classes reading the class token. Its parameters are
PyTorch's initialisation under a fixed seed (the class token and positions drawn from N(0, 0.02²)).
The export is `torch.onnx.export(dynamo=False, opset_version=17)` with a dynamic batch. The file
is committed, so the tests need no PyTorch.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEED = 20261128
CHANNELS, SIDE, PATCH, WIDTH, HEADS, BLOCKS, CLASSES = 3, 16, 4, 32, 4, 2, 10


def module(seed: int = SEED):
    """The model, freshly initialised under `seed` (PyTorch needed)."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
            self.proj = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            n, t, d = x.shape
            q, k, v = self.qkv(x).split(WIDTH, dim=2)
            q, k, v = (part.view(n, t, HEADS, d // HEADS).transpose(1, 2) for part in (q, k, v))
            scores = q @ k.transpose(-2, -1) / math.sqrt(d // HEADS)
            context = torch.softmax(scores, dim=-1) @ v
            return self.proj(context.transpose(1, 2).reshape(n, t, d))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.attn = Attention()
            self.mlp = nn.Sequential(
                nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
            )

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class ViT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            tokens = (SIDE // PATCH) ** 2
            self.patches = nn.Conv2d(CHANNELS, WIDTH, PATCH, stride=PATCH)
            self.cls = nn.Parameter(torch.randn(1, 1, WIDTH) * 0.02)
            self.pos = nn.Parameter(torch.randn(1, tokens + 1, WIDTH) * 0.02)
            self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
            self.ln = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, CLASSES)

        def forward(self, images):
            x = self.patches(images).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
            return self.head(self.ln(self.blocks(x))[:, 0])

    torch.manual_seed(seed)
    return ViT().eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "tiny_vit.onnx"))
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("export_tiny_vit: needs PyTorch (pip install torch)", file=sys.stderr)
        return 2
    torch.onnx.export(
        module(),
        (torch.zeros(1, CHANNELS, SIDE, SIDE),),
        args.out,
        input_names=["images"],
        output_names=["logits"],
        dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
