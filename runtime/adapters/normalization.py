"""Adapters of batchnorm: statistics, normalisation, running statistics and the two backwards.

Vanilla batchnorm normalises each (c, h, w) over the batch, which is spatial batchnorm on the
piece viewed as (N, C·H·W, 1, 1); the views below do that reshaping. In evaluation the forward
normalises with the running statistics and leaves them alone.
"""

from __future__ import annotations

import numpy as np

from runtime.adapters.registry import adapter
from runtime.kernels import batchnorm


def _per_feature(x: np.ndarray, spatial: bool) -> np.ndarray:
    """Vanilla batchnorm normalises each (c, h, w) over the batch: spatial batchnorm on (N, CHW)."""
    return x if spatial else x.reshape(x.shape[0], -1, 1, 1)


def _stats_view(stats: np.ndarray, spatial: bool) -> np.ndarray:
    return stats if spatial else stats.reshape(stats.shape[0], -1, 1, 1)


@adapter("batchnorm_stats.forward")
def _bn_stats(task, piece, views, dims, ctx):
    if not ctx.training:  # evaluation normalises with the running statistics: none are read
        return {"stats": np.zeros(views["stats"].shape, views["stats"].dtype)}
    spatial = task.attrs["spatial"]
    stats = batchnorm.batchnorm_stats(_per_feature(views["input"], spatial))
    return {"stats": stats.reshape(views["stats"].shape)}


@adapter("batchnorm.forward")
def _bn(task, piece, views, dims, ctx):
    spatial, x = task.attrs["spatial"], views["input"]
    if not ctx.training:
        y = batchnorm.batchnorm_inference(
            _per_feature(x, spatial),
            _stats_view(views["running"], spatial),
            _stats_view(views["gamma"], spatial),
            _stats_view(views["beta"], spatial),
            task.attrs["eps"],
        )
        return {"output": y.reshape(x.shape)}
    y = batchnorm.batchnorm_forward(
        _per_feature(x, spatial),
        _stats_view(views["stats"], spatial),
        task.attrs["count"],
        _stats_view(views["gamma"], spatial),
        _stats_view(views["beta"], spatial),
        task.attrs["eps"],
    )
    return {"output": y.reshape(x.shape)}


@adapter("batchnorm_running.forward")
def _bn_running(task, piece, views, dims, ctx):
    if not ctx.training:
        return {}
    spatial = task.attrs.get("spatial", True)
    running = _stats_view(views["running"], spatial)
    running[...] = batchnorm.batchnorm_running(
        running, _stats_view(views["stats"], spatial), task.attrs["count"], task.attrs["momentum"]
    )
    return {}


@adapter("batchnorm.backward")
def _bn_param_grad(task, piece, views, dims, ctx):
    spatial = task.attrs["spatial"]
    dgamma, dbeta = batchnorm.batchnorm_param_backward(
        _per_feature(views["output.delta"], spatial),
        _per_feature(views["input"], spatial),
        _stats_view(views["stats"], spatial),
        task.attrs["count"],
        task.attrs["eps"],
    )
    shape = views["gamma.delta"].shape
    return {"gamma.delta": dgamma.reshape(shape), "beta.delta": dbeta.reshape(shape)}


@adapter("batchnorm_input.backward")
def _bn_input_grad(task, piece, views, dims, ctx):
    spatial, x = task.attrs["spatial"], views["input"]
    dx = batchnorm.batchnorm_input_backward(
        _per_feature(views["output.delta"], spatial),
        _per_feature(x, spatial),
        _stats_view(views["stats"], spatial),
        task.attrs["count"],
        _stats_view(views["gamma"], spatial),
        _stats_view(views["gamma.delta"], spatial),
        _stats_view(views["beta.delta"], spatial),
        task.attrs["eps"],
    )
    return {"input.delta": dx.reshape(x.shape)}
