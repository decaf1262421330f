"""The PyTorch peer of a legion-nn network, for `legion-nn bench step`: the same layers, trained
the same way (softmax cross-entropy, Adam), timed as legion-nn's step is.

Untied filters are PyTorch's usual locally connected recipe, `bench kernels`' untied peer: unfold
the input's windows, then one batched matmul over the output positions, each with its own
(K, C·R·S) weights, operands made contiguous first (several times faster than `bmm` on permuted
views); tied filters are `conv2d`; the sequence layers are PyTorch's own (`nn.Embedding`,
`nn.Linear`, `nn.LayerNorm`, `F.gelu`, `@` of heads). Other layers raise `Unsupported`.
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np

from legion_nn.network import INPUT, Network


class Unsupported(Exception):
    """A layer the peer has no PyTorch counterpart for."""


def peer_model(network: Network):
    """(model, its loss on (x, y)) for `network`: its layers, each reading the layers its
    `inputs` name, as PyTorch modules (filters, filterA, filterNL, linear, and the sequence
    layers: embeddings, dense, LayerNorm, GELU, heads, products, row softmax, slices, add)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Untied(nn.Module):
        def __init__(self, c, k, r, s, p, q, stride, pad) -> None:
            super().__init__()
            self.shape = (k, r, s, p, q, stride, pad)
            self.w = nn.Parameter(torch.randn(p * q, k, c * r * s) / math.sqrt(c * r * s))

        def forward(self, x):
            k, r, s, p, q, stride, pad = self.shape
            cols = F.unfold(F.pad(x, pad), (r, s), stride=stride).permute(2, 1, 0).contiguous()
            return torch.bmm(self.w, cols).permute(2, 1, 0).reshape(x.shape[0], k, p, q)

    class Tied(nn.Module):
        def __init__(self, c, k, r, s, stride, pad) -> None:
            super().__init__()
            self.stride, self.pad = stride, pad
            self.w = nn.Parameter(torch.randn(k, c, r, s) / math.sqrt(c * r * s))

        def forward(self, x):
            return F.conv2d(F.pad(x, self.pad), self.w, stride=self.stride)

    class Affine(nn.Module):
        def __init__(self, k, p, q, a) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.full((1,), float(a)))
            self.b = nn.Parameter(torch.zeros(1, k, p, q))

        def forward(self, x):
            return self.a * x + self.b

    class Apply(nn.Module):
        def __init__(self, fn) -> None:
            super().__init__()
            self.fn = fn

        def forward(self, *xs):
            return self.fn(*xs)

    class Positions(nn.Module):
        def __init__(self, tokens, features) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(tokens, features))

        def forward(self, x):
            return x + self.w

    class Scores(nn.Module):
        def __init__(self, tokens, causal) -> None:
            super().__init__()
            mask = torch.ones(tokens, tokens, dtype=torch.bool).triu(1) if causal else None
            self.register_buffer("mask", mask)

        def forward(self, x):
            if self.mask is not None:
                x = x.masked_fill(self.mask, float("-inf"))
            return torch.softmax(x, dim=-1)

    def heads(count):
        def split(x):
            n, t, d = x.shape
            return x.view(n, t, count, d // count).transpose(1, 2)

        return split

    def merged(x):
        n, h, t, d = x.shape
        return x.transpose(1, 2).reshape(n, t, h * d)

    def product(layer):
        def multiply(a, b):
            return layer.scale * (a @ (b.transpose(-2, -1) if layer.transpose_b else b))

        return multiply

    nonlinear = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}
    steps: list = []
    for layer, names, shape, _ in network._wired():
        kind = layer.KIND
        if kind == "filter":
            c, h, w = shape
            (r, s), k = layer.kernel, layer.out_channels
            top, bottom, left, right = layer.pad
            p = (h + top + bottom - r) // layer.stride + 1
            q = (w + left + right - s) // layer.stride + 1
            pad = (left, right, top, bottom)  # F.pad's order: last dim first
            if layer.untied:
                module = Untied(c, k, r, s, p, q, layer.stride, pad)
            else:
                module = Tied(c, k, r, s, layer.stride, pad)
        elif kind == "filterA":
            module = Affine(*shape, layer.a_init)
        elif kind == "filterNL":
            module = Apply(nonlinear[layer.fn])
        elif kind == "linear":
            module = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), layer.out, layer.bias))
        elif kind == "embedding":
            module = nn.Embedding(layer.vocab, layer.dim)
        elif kind == "position":
            module = Positions(*shape)
        elif kind == "dense":
            module = nn.Linear(shape[-1], layer.out, bias=layer.bias)
        elif kind == "layernorm":
            module = nn.LayerNorm(shape[-1], eps=layer.eps)
        elif kind == "gelu":
            module = Apply(lambda x, a=layer.approximate: F.gelu(x, approximate=a))
        elif kind == "split_heads":
            module = Apply(heads(layer.heads))
        elif kind == "merge_heads":
            module = Apply(merged)
        elif kind == "matmul":
            module = Apply(product(layer))
        elif kind == "row_softmax":
            module = Scores(shape[1], layer.causal)
        elif kind == "slice":
            module = Apply(lambda x, a=layer.start, b=layer.stop: x[..., a:b])
        elif kind == "add":
            module = Apply(lambda *xs: sum(xs[1:], xs[0]))
        elif kind in ("softmax", "evaluate"):
            continue
        else:
            raise Unsupported(f"layer {layer.name}: {kind} has no PyTorch peer here")
        steps.append((layer.name, names, module))

    class Peer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(module for _, _, module in steps)

        def __getitem__(self, index: int):
            return self.layers[index]

        def forward(self, x):
            made = {INPUT: x}
            for (name, names, _), module in zip(steps, self.layers):
                made[name] = module(*(made[n] for n in names))
            return made[steps[-1][0]]

    model = Peer()

    def loss_of(x, y):
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return model, loss_of


def peer_step_seconds(network: Network, batch: int, warmup: int, steps: int) -> float:
    """The median of `steps` training steps of the peer after `warmup`, on random data."""
    import torch

    torch.manual_seed(0)
    model, loss_of = peer_model(network)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    if network.tokens:
        dims = (batch, *network.input)
        x = torch.from_numpy(rng.integers(0, network.vocab, dims).astype(np.int64))
        y = torch.from_numpy(rng.integers(0, network.classes, dims).astype(np.int64))
    else:
        x = torch.from_numpy(rng.standard_normal((batch, *network.input)).astype(np.float32))
        y = torch.from_numpy(rng.integers(0, network.classes, batch).astype(np.int64))
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_of(x, y).backward()
        optimizer.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
