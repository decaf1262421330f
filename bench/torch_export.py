"""What the fixture exporters share: PyTorch's ONNX export as the fixtures are made, and the
pre-norm transformer block of the GPT and ViT fixtures (PyTorch needed)."""

from __future__ import annotations

import math
import sys


def export(make, input_name: str, out: str) -> int:
    """The model `make(torch)` gives, with an example input, `(model, example)`, exported to
    `out` as the fixtures are: opset 17, the TorchScript exporter, a dynamic batch; 2 (and one
    line) without PyTorch."""
    try:
        import torch
    except ImportError:
        print(f"{out}: exporting needs PyTorch (pip install torch)", file=sys.stderr)
        return 2
    model, example = make(torch)
    torch.onnx.export(
        model,
        (example,),
        out,
        input_names=[input_name],
        output_names=["logits"],
        dynamic_axes={input_name: {0: "batch"}, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    print(f"wrote {out}")
    return 0


def block(width: int, heads: int, causal_length: int | None = None):
    """A pre-norm block as users write one: x + attention(ln1(x)), then + mlp(ln2(x)). Q, K and
    V come from one `nn.Linear` split in three; with `causal_length`, the causal mask is a
    registered buffer applied with `masked_fill`; the MLP is Linear, GELU, Linear of 4·width."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            if causal_length is not None:
                mask = torch.tril(torch.ones(causal_length, causal_length, dtype=torch.bool))
                self.register_buffer("mask", mask.view(1, 1, causal_length, causal_length))

        def forward(self, x):
            n, t, d = x.shape
            q, k, v = self.qkv(x).split(width, dim=2)
            q, k, v = (part.view(n, t, heads, d // heads).transpose(1, 2) for part in (q, k, v))
            scores = q @ k.transpose(-2, -1) / math.sqrt(d // heads)
            if causal_length is not None:
                scores = scores.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
            context = torch.softmax(scores, dim=-1) @ v
            return self.proj(context.transpose(1, 2).reshape(n, t, d))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.attn = Attention()
            self.mlp = nn.Sequential(
                nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
            )

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    return Block()
