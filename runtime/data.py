"""Training data: scikit-learn's bundled digits, seeded synthetic data, or an `.npz` file.

Every source yields a `Dataset` of train, validation and test splits, resized to the network's
per-sample input (C, H, W), as float arrays in [0, 1]-ish scale, with int32 labels.

- `digits`: the 1,797 8×8 handwritten digits that ship inside scikit-learn (real data, no
  download), scaled to [0, 1] and resized bilinearly to the input; with more than one input
  channel the image is repeated across channels. The split (70/15/15) uses a fixed permutation,
  independent of the training seed, so test accuracies are comparable between runs.
- `synthetic`: one random prototype image per class plus Gaussian noise, seeded; learnable, so a
  loss curve means something.
- `F.npz`: `x_train`, `y_train` and optionally `x_val`, `y_val`, `x_test`, `y_test`, used as given
  (a split it lacks is empty); or arrays `x` and `y` (N,), split as digits is. Images are
  (N, C, H, W) or (N, H, W), resized like digits.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np

from legion_nn.errors import LegionNNError
from runtime import token_data
from runtime.data_dir import load_dir
from runtime.dataset import Dataset, Split, npz_splits, read_npz

SPLIT_SEED = 20261122
SPLITS = (0.7, 0.15)


def _resize_axis(images: np.ndarray, size: int, axis: int) -> np.ndarray:
    """Bilinear resampling of one axis, aligning pixel centres."""
    old = images.shape[axis]
    if old == size:
        return images
    positions = (np.arange(size) + 0.5) * old / size - 0.5
    positions = np.clip(positions, 0, old - 1)
    low = np.floor(positions).astype(int)
    high = np.minimum(low + 1, old - 1)
    weight = positions - low
    shape = [1] * images.ndim
    shape[axis] = size
    weight = weight.reshape(shape)
    return (
        np.take(images, low, axis=axis) * (1 - weight) + np.take(images, high, axis=axis) * weight
    )


def fit_to_input(x: np.ndarray, shape: tuple[int, int, int], source: str) -> np.ndarray:
    """(N, C, H, W) or (N, H, W) images resized to (N, *shape)."""
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise LegionNNError(
            f"{source}: x must be (N, C, H, W) or (N, H, W), got shape {list(x.shape)}"
        )
    channels, height, width = shape
    if x.shape[1] not in (1, channels):
        raise LegionNNError(
            f"{source}: x has {x.shape[1]} channels but the network takes {channels}"
        )
    x = _resize_axis(_resize_axis(x.astype(np.float64), height, 2), width, 3)
    if x.shape[1] != channels:
        x = np.repeat(x, channels, axis=1)
    return x


def _split(x: np.ndarray, y: np.ndarray, name: str, dtype) -> Dataset:
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    x, y = x[order].astype(dtype), y[order].astype(np.int32)
    n_train = round(SPLITS[0] * len(y))
    n_val = round(SPLITS[1] * len(y))
    return Dataset(
        name,
        Split(x[:n_train], y[:n_train]),
        Split(x[n_train : n_train + n_val], y[n_train : n_train + n_val]),
        Split(x[n_train + n_val :], y[n_train + n_val :]),
    )


def digits(shape: tuple[int, int, int], classes: int, dtype=np.float32) -> Dataset:
    if classes < 10:
        raise LegionNNError(f"digits has 10 classes but the network has {classes}")
    images, labels = bundled_digits()
    return _split(fit_to_input(images / 16.0, shape, "digits"), labels, "digits", dtype)


def bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits, images (1797, 8, 8) in 0-16 and their labels, read from the file
    it ships without importing it: that import was 1.9 s of the default job's 2.8 s start-up.
    Where the file is not where this looks, scikit-learn's own reader reads it."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise LegionNNError("--data digits needs scikit-learn, which ships the digits")
    package = Path(next(iter(spec.submodule_search_locations)))
    path = package / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        from sklearn.datasets import load_digits

        data = load_digits()
        return data.images, data.target
    rows = np.loadtxt(path, delimiter=",")
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int64)


def synthetic(
    shape: tuple[int, int, int], classes: int, seed: int = 0, samples: int = 1200, dtype=np.float32
) -> Dataset:
    rng = np.random.default_rng(seed)
    prototypes = rng.uniform(0, 1, size=(classes,) + tuple(shape))
    y = rng.integers(0, classes, size=samples)
    x = prototypes[y] + 0.3 * rng.standard_normal((samples,) + tuple(shape))
    return _split(x, y, "synthetic", dtype)


def from_npz(path: str, shape: tuple[int, int, int], classes: int, dtype=np.float32) -> Dataset:
    """`x_train`, `y_train` (and optionally `x_val`, `y_val`, `x_test`, `y_test`) used as given,
    in their order; or `x` and `y`, split 70/15/15 as digits is."""
    arrays = read_npz(path)
    if "x_train" in arrays or "y_train" in arrays:

        def read(part: str, x: np.ndarray, y: np.ndarray) -> Split:
            x, y = _checked(path, x, y, classes, part)
            return Split(fit_to_input(x, shape, path).astype(dtype), y)

        empty = Split(np.zeros((0, *shape), dtype), np.zeros(0, np.int32))
        return npz_splits(path, arrays, read, empty)
    if "x" not in arrays or "y" not in arrays:
        raise LegionNNError(
            f"{path}: needs arrays 'x_train' and 'y_train' (and optionally x_val, y_val, x_test, "
            f"y_test), or 'x' and 'y'; has {sorted(arrays)}"
        )
    x, y = _checked(path, arrays["x"], arrays["y"], classes, "")
    if len(y) < 3:
        raise LegionNNError(f"{path}: needs at least 3 samples to split, has {len(y)}")
    return _split(fit_to_input(x, shape, path), y, Path(path).name, dtype)


def _checked(
    path: str, x: np.ndarray, y: np.ndarray, classes: int, part: str
) -> tuple[np.ndarray, np.ndarray]:
    """`x` and its labels `y` as int32, or one line saying what is wrong with them."""
    names = (f"x_{part}", f"y_{part}") if part else ("x", "y")
    y = np.asarray(y).reshape(-1)
    if len(y) != len(x):
        raise LegionNNError(f"{path}: {names[0]} has {len(x)} samples but {names[1]} has {len(y)}")
    if len(y) and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= classes):
        raise LegionNNError(f"{path}: labels {names[1]} must be integers in [0, {classes})")
    return np.asarray(x), y.astype(np.int32)


def load(
    source: str, shape: tuple[int, ...], classes: int, seed: int, dtype, vocab: int | None = None
) -> Dataset:
    """The dataset `source` names for a network of per-sample input `shape`: images, or token
    ids below `vocab` (`runtime.token_data`)."""
    if os.path.isdir(source):
        label_shape = tuple(shape) if len(shape) == 1 else ()
        return load_dir(source, shape, label_shape, classes, vocab if len(shape) == 1 else None)
    if len(shape) == 1:
        return token_data.load(source, shape[0], vocab or classes, classes, seed)
    if source == "digits":
        return digits(shape, classes, dtype)
    if source == "synthetic":
        return synthetic(shape, classes, seed, dtype=dtype)
    if source.endswith(".npz"):
        return from_npz(source, shape, classes, dtype)
    raise LegionNNError(
        f"--data must be digits, synthetic, a .npz file or a directory of .npy files, got {source!r}"
    )
