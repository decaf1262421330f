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
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.torch_export import block, export

SEED = 20261128
CHANNELS, SIDE, PATCH, WIDTH, HEADS, BLOCKS, CLASSES = 3, 16, 4, 32, 4, 2, 10


def module(seed: int = SEED):
    """The model, freshly initialised under `seed` (PyTorch needed)."""
    import torch
    from torch import nn

    class ViT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            tokens = (SIDE // PATCH) ** 2
            self.patches = nn.Conv2d(CHANNELS, WIDTH, PATCH, stride=PATCH)
            self.cls = nn.Parameter(torch.randn(1, 1, WIDTH) * 0.02)
            self.pos = nn.Parameter(torch.randn(1, tokens + 1, WIDTH) * 0.02)
            self.blocks = nn.Sequential(*(block(WIDTH, HEADS) for _ in range(BLOCKS)))
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
    return export(
        lambda torch: (module(), torch.zeros(1, CHANNELS, SIDE, SIDE)), "images", args.out
    )


if __name__ == "__main__":
    sys.exit(main())
