"""`Dataset`: a training set's train, validation and test splits, each samples x with targets y.

`runtime.data` makes them from images, `runtime.token_data` from token ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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


#: the parts of a dataset an `.npz` may hold, as x_<part> and y_<part>
PARTS = ("train", "val", "test")


def npz_splits(path: str, arrays: dict, read: Callable, empty: Split) -> Dataset:
    """The dataset of an `.npz`'s `x_<part>` and `y_<part>` arrays: `read(part, x, y)` makes a
    part's split; a part the file lacks is `empty`; a part with one array of the two, or no
    training sample, is one line."""
    splits = {}
    for part in PARTS:
        x_name, y_name = f"x_{part}", f"y_{part}"
        if (x_name in arrays) != (y_name in arrays):
            given, missing = (x_name, y_name) if x_name in arrays else (y_name, x_name)
            raise LegionNNError(f"{path}: has {given!r} but not {missing!r}")
        splits[part] = read(part, arrays[x_name], arrays[y_name]) if x_name in arrays else empty
    if not len(splits["train"]):
        raise LegionNNError(f"{path}: x_train has no samples")
    return Dataset(Path(path).name, splits["train"], splits["val"], splits["test"])
