"""The ONNX reader's image ops (`onnx_model._Reader`): Conv, Gemm and MatMul, the pools, batch
normalisation and LRN, each as a layer with its parameters taken from the model's constants.
"""

from __future__ import annotations

import numpy as np

from legion_nn.layers import LRN, AvgPool, BatchNorm, Conv, Linear, MaxPool


class ImageOps:
    """The image ops of `onnx_model._Reader`, which provides `constants`, `initial`, `shape`,
    `linear_count`, `fail`, `_add` and `_param`."""

    def _image_node(self, node, attrs: dict, name: str, index: int) -> bool:
        """Whether `node` is one of these ops, its layer added if so."""
        op = node.op_type
        if op == "Conv":
            self._conv(node, attrs, name)
        elif op == "Gemm":
            if attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
                raise self.fail(node, "alpha and beta other than 1 are not supported")
            if attrs.get("transA", 0):
                raise self.fail(node, "transA is not supported")
            weights = self.constants[node.input[1]]
            weights = weights if attrs.get("transB", 0) else weights.T
            bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
            self._linear(node, weights, bias, index)
        elif op == "MatMul":
            self._linear(node, self.constants[node.input[1]].T, None, index)
        elif op == "MaxPool":
            self._window_checks(node, attrs)
            kernel = tuple(attrs["kernel_shape"])
            self._add(
                MaxPool(
                    name,
                    kernel=kernel,
                    stride=tuple(attrs.get("strides", kernel)),
                    pad=_pads(attrs.get("pads", [0, 0, 0, 0])),
                )
            )
        elif op == "AveragePool":
            self._window_checks(node, attrs)
            if attrs.get("count_include_pad", 0) and any(attrs.get("pads", [0])):
                raise self.fail(node, "count_include_pad 1 with pads is not supported")
            kernel = tuple(attrs["kernel_shape"])
            self._add(
                AvgPool(
                    name,
                    kernel=kernel,
                    stride=tuple(attrs.get("strides", [1, 1])),
                    pad=_pads(attrs.get("pads", [0, 0, 0, 0])),
                )
            )
        elif op == "GlobalAveragePool":
            self._add(AvgPool(name, kernel=self.shape[1:], stride=1))
        elif op == "BatchNormalization":
            scale, bias, mean, var = (self.constants[i] for i in node.input[1:5])
            layer = BatchNorm(
                name,
                spatial=True,
                eps=float(attrs.get("epsilon", 1e-5)),
                momentum=float(attrs.get("momentum", 0.9)),
            )
            self._add(layer)
            per = (1, len(scale), 1, 1)
            self._param(f"{name}.gamma", node.input[1], scale.reshape(per))
            self._param(f"{name}.beta", node.input[2], bias.reshape(per))
            running = np.stack((mean, var)).reshape((2, len(mean), 1, 1)).astype(np.float64)
            self.initial[f"{name}.running"] = running
        elif op == "LRN":
            self._add(
                LRN(
                    name,
                    size=int(attrs["size"]),
                    alpha=float(attrs.get("alpha", 1e-4)),
                    beta=float(attrs.get("beta", 0.75)),
                    bias=float(attrs.get("bias", 1.0)),
                )
            )
        else:
            return False
        return True

    def _window_checks(self, node, attrs: dict) -> None:
        if attrs.get("ceil_mode", 0) or any(d != 1 for d in attrs.get("dilations", [1, 1])):
            raise self.fail(node, "ceil_mode and dilations are not supported")
        self._explicit_pads(node, attrs)

    def _explicit_pads(self, node, attrs: dict) -> None:
        if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            raise self.fail(node, "auto_pad is not supported; give pads")

    def _conv(self, node, attrs: dict, name: str) -> None:
        if any(d != 1 for d in attrs.get("dilations", [1, 1])):
            raise self.fail(node, "dilated Conv is not supported")
        self._explicit_pads(node, attrs)
        strides = attrs.get("strides", [1, 1])
        if len(set(strides)) != 1:
            raise self.fail(node, f"strides {list(strides)} differ; legion-nn needs one stride")
        weights = self.constants[node.input[1]]
        if weights.ndim != 4:
            raise self.fail(node, "only 2-D convolutions are supported")
        k, c, r, s = weights.shape
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        layer = Conv(
            name,
            out_channels=k,
            kernel=(r, s),
            stride=int(strides[0]),
            pad=_pads(attrs.get("pads", [0, 0, 0, 0])),
            bias=bias is not None,
            groups=int(attrs.get("group", 1)),
        )
        self._add(layer)
        self._param(f"{name}.W", node.input[1], weights.reshape(k, 1, 1, c, r, s, 1, 1))
        if bias is not None:
            self._param(f"{name}.b", bias, self.constants[bias].reshape(1, k, 1, 1))

    def _linear(self, node, weights: np.ndarray, bias: str | None, index: int) -> None:
        """A linear layer of `weights` (M, K) over a flat input of K features."""
        name = self.layer_names[index]
        self.linear_count += 1
        out, features = weights.shape
        self._add(Linear(name, out=out, bias=bias is not None))
        self._param(
            f"{name}.weights{self.linear_count}",
            node.input[1],
            np.ascontiguousarray(weights).reshape(out, features, 1, 1),
        )
        if bias is not None:
            value = self.constants[bias].reshape(-1)
            if value.size != out:
                raise self.fail(node, f"bias of {value.size} values for {out} outputs")
            self._param(f"{name}.b{self.linear_count}", bias, value.reshape(1, out, 1, 1))


def _pads(pads) -> list[int]:
    """ONNX pads (top, left, bottom, right) as legion-nn's [top, bottom, left, right]."""
    top, left, bottom, right = (int(p) for p in pads)
    return [top, bottom, left, right]
