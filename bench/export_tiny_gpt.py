"""Make `tests/fixtures/tiny_gpt.onnx`: a GPT-style decoder built and exported by PyTorch.

    pip install torch && python bench/export_tiny_gpt.py [--out tests/fixtures/tiny_gpt.onnx]

The model, as a user writes one: `nn.Embedding` of tokens and of positions (read at
`arange(T)`), 2 pre-norm blocks of causal multi-head attention (4 heads, width 32; Q, K and V
from one `nn.Linear` split in three, the mask a registered buffer applied with `masked_fill`) and
an MLP of `nn.Linear`, `nn.GELU` and `nn.Linear`, then `nn.LayerNorm` and a head over a vocabulary
of 64; sequence 16. Its parameters are PyTorch's initialisation under a fixed seed. The export is
`torch.onnx.export(dynamo=False, opset_version=17)` with a dynamic batch, so it holds Gather,
LayerNormalization, MatMul of two activations, Transpose, Reshape, Split, Softmax, Where, Erf,
Div, Mul, Add and the shape arithmetic on constants the issue lists. The file is committed, so the
tests need no PyTorch; `module()` builds the same model for the tests that compare with PyTorch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.torch_export import block, export

SEED = 20261127
VOCAB, WIDTH, HEADS, BLOCKS, LENGTH = 64, 32, 4, 2, 16


def module(seed: int = SEED):
    """The model, freshly initialised under `seed` (PyTorch needed)."""
    import torch
    from torch import nn

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(VOCAB, WIDTH)
            self.pos = nn.Embedding(LENGTH, WIDTH)
            self.blocks = nn.Sequential(*(block(WIDTH, HEADS, LENGTH) for _ in range(BLOCKS)))
            self.ln_f = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, ids):
            positions = torch.arange(ids.shape[1], device=ids.device)
            x = self.tok(ids) + self.pos(positions)
            return self.head(self.ln_f(self.blocks(x)))

    torch.manual_seed(seed)
    return GPT().eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "tiny_gpt.onnx"))
    args = parser.parse_args(argv)
    return export(
        lambda torch: (module(), torch.zeros(1, LENGTH, dtype=torch.int64)), "ids", args.out
    )


if __name__ == "__main__":
    sys.exit(main())
