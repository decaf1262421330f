"""`Dataset`: a training set's train, validation and test splits, each samples x with targets y.

`runtime.data` makes them from images, `runtime.token_data` from token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from legion_nn.errors import LegionNNError


@dataclass
class Split:
    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class Dataset:
    name: str
    train: Split
    val: Split
    test: Split


def read_npz(path: str) -> dict[str, np.ndarray]:
    """Every array of an `.npz` file, or one line saying why it cannot be read."""
    try:
        with np.load(path) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError) as exc:
        raise LegionNNError(f"{path}: cannot read as .npz: {exc}") from None
