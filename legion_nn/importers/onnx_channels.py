"""The ONNX reader's per-channel image ops: what the model zoo's DenseNet, Inception v2 and
ShuffleNet write, as layers.

| ONNX | layer |
|---|---|
| Unsqueeze, Reshape, Squeeze or Flatten of a parameter | (folded: the parameter under a shape that broadcasts) |
| Mul by one constant per channel, and an Add of another after it | `channel_affine` (scale and shift) |
| Reshape to (N, g, C/g, H, W), Transpose (0, 2, 1, 3, 4), Reshape to (N, C, H, W) | `channel_shuffle` (g groups) |

A per-channel constant becomes a parameter, as a Conv's weights do, whether it is an
initializer or computed without data (the model zoo's weights are ConstantOfShape nodes); a
parameter's view keeps the parameter's name, so `--save-onnx` writes it back there.
"""

from __future__ import annotations

import numpy as np

from legion_nn.importers.onnx_fold import evaluate
from legion_nn.layers import ChannelAffine, ChannelShuffle

#: ops that give a parameter another shape (to broadcast it), folded at import
PARAMETER_VIEWS = ("Unsqueeze", "Reshape", "Squeeze", "Flatten")


class ChannelOps:
    """The per-channel ops of `onnx_model._Reader`, which provides `constants`, `params`,
    `viewed`, `values`, `claimed`, `outputs`, `opsets`, `shape`, `_read`, `_add`, `_param`,
    `_made`, `name_of`, and `SequenceOps`' `_only_consumer`, `_bias_after` and `_target`."""

    def _parameter_view(self, node) -> bool:
        """A parameter given another shape to broadcast (DenseNet's Unsqueeze of a batch norm's
        scale): its value is folded here, and a layer reading it takes it as that parameter."""
        if node.op_type not in PARAMETER_VIEWS or not node.input:
            return False
        if node.input[0] not in self.params or any(
            i not in self.constants for i in node.input if i
        ):
            return False
        feed = {i: self.constants[i] for i in node.input if i}
        (value,) = evaluate(node, feed, self.opsets)
        self.constants[node.output[0]] = np.asarray(value)
        self.params.add(node.output[0])
        self.viewed[node.output[0]] = self.viewed.get(node.input[0], node.input[0])
        return True

    def _per_channel(self, name: str) -> np.ndarray | None:
        """The constant `name` as one value per channel of the current (C, H, W), (1, C, 1, 1),
        or None where it is none that broadcasts so."""
        value = self.constants.get(name)
        if value is None or not np.issubdtype(value.dtype, np.floating) or len(self.shape) != 3:
            return None
        if value.ndim > 4:
            return None
        channels = self.shape[0]
        padded = (1,) * (4 - value.ndim) + value.shape
        if padded[1] != channels or padded[0] * padded[2] * padded[3] != 1:
            return None
        return value.reshape(1, channels, 1, 1)

    def _channel_affine(self, node):
        """A Mul by one constant per channel, and the Add of another after it if there is one
        (read with it), as one `channel_affine` layer; the node whose output it makes, or None
        where `node` is no such Mul."""
        if node.op_type != "Mul":
            return None
        scales = [(i, v) for i in node.input if (v := self._per_channel(i)) is not None]
        if len(scales) != 1:
            return None
        (scale_name, scale), last = scales[0], node
        after, shift_name = self._bias_after(node, self.shape[0])
        shift = None
        if after is not None and node.output[0] not in self.outputs:
            shift = self._per_channel(shift_name)
        if shift is not None:
            self.claimed.add(id(after))
            last = after
        name = self.name_of(node)
        self._add(ChannelAffine(name, shift=shift is not None))
        self._param(f"{name}.scale", self.viewed.get(scale_name, scale_name), scale)
        if shift is not None:
            self._param(f"{name}.shift", self.viewed.get(shift_name, shift_name), shift)
        return last

    def _channel_shuffle(self, node, data: list[str]) -> bool:
        """ShuffleNet's channel shuffle: a Reshape to (N, g, C/g, H, W), a Transpose swapping g
        and C/g, and a Reshape back to (N, C, H, W), each read by the next alone, as one
        `channel_shuffle` layer of g groups."""
        if node.op_type != "Reshape" or len(data) != 1 or data[0] not in self.values:
            return False
        target = self.constants.get(node.input[1])
        shape = self.values[data[0]][1]
        if target is None or target.size != 5 or len(shape) != 3:
            return False
        channels, rows, cols = shape
        groups, per, *plane = self._target(node)
        if groups == -1 and per > 0:
            groups = channels // per
        if per == -1 and groups > 0:
            per = channels // groups
        if groups < 1 or groups * per != channels or plane != [rows, cols]:
            return False
        transpose = self._only_consumer(node.output[0], "Transpose")
        if transpose is None or node.output[0] in self.outputs:
            return False
        if list(self.attributes(transpose).get("perm", [])) != [0, 2, 1, 3, 4]:
            return False
        back = self._only_consumer(transpose.output[0], "Reshape")
        if back is None or transpose.output[0] in self.outputs:
            return False
        if self._target(back) not in ([channels, rows, cols], [-1, rows, cols]):
            return False
        self.claimed.update((id(transpose), id(back)))
        self._read(data[0])
        self._add(ChannelShuffle(self.name_of(node), groups=groups))
        self._made(back.output[0])
        return True
