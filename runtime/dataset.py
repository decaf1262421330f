"""`Dataset`: a training set's train, validation and test splits, each samples x with targets y.

`runtime.data` makes them from images, `runtime.token_data` from token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
