"""The PyTorch peer of a legion-nn network, for `legion-nn bench step`: the same layers, trained
the same way (softmax cross-entropy, Adam), timed as legion-nn's step is.

Untied filters are PyTorch's usual locally connected recipe, `bench kernels`' untied peer: unfold
the input's windows, then one batched matmul over the output positions, each with its own
(K, C·R·S) weights, operands made contiguous first (several times faster than `bmm` on permuted
views); tied filters are `conv2d`. Layers a chain of these does not cover raise `Unsupported`.
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np

from legion_nn.layers import Evaluate, Filter, FilterA, FilterNL, Linear, Softmax
from legion_nn.network import Network


class Unsupported(Exception):
    """A layer the peer has no PyTorch counterpart for."""


def peer_model(network: Network):
    """(model, its loss on (x, y)) for `network`, a chain of filter, filterA, filterNL, linear
    and softmax layers."""
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

        def forward(self, x):
            return self.fn(x)

    nonlinear = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}
    modules: list = []
    c, h, w = network.input
    for layer in network.layers:
        if layer.inputs:
            raise Unsupported(f"layer {layer.name} reads {list(layer.inputs)}: not a chain")
        if isinstance(layer, Filter):
            (r, s), k = layer.kernel, layer.out_channels
            top, bottom, left, right = layer.pad
            p = (h + top + bottom - r) // layer.stride + 1
            q = (w + left + right - s) // layer.stride + 1
            pad = (left, right, top, bottom)  # F.pad's order: last dim first
            if layer.untied:
                modules.append(Untied(c, k, r, s, p, q, layer.stride, pad))
            else:
                modules.append(Tied(c, k, r, s, layer.stride, pad))
            c, h, w = k, p, q
        elif isinstance(layer, FilterA):
            modules.append(Affine(c, h, w, layer.a_init))
        elif isinstance(layer, FilterNL):
            modules.append(Apply(nonlinear[layer.fn]))
        elif isinstance(layer, Linear):
            modules.append(nn.Flatten())
            modules.append(nn.Linear(c * h * w, layer.out, bias=layer.bias))
            c, h, w = layer.out, 1, 1
        elif not isinstance(layer, (Softmax, Evaluate)):
            raise Unsupported(
                f"layer {layer.name}: {type(layer).__name__} has no PyTorch peer here"
            )
    model = nn.Sequential(*modules)
    return model, lambda x, y: F.cross_entropy(model(x), y)


def peer_step_seconds(network: Network, batch: int, warmup: int, steps: int) -> float:
    """The median of `steps` training steps of the peer after `warmup`, on random data."""
    import torch

    torch.manual_seed(0)
    model, loss_of = peer_model(network)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
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
