"""Token data for networks that read token ids (T,): sequences with a target per token.

Every source yields a `Dataset` whose x are int32 ids (N, T) and whose y are int32 targets (N, T).

- `F.txt` (or any other file but `.npz`): UTF-8 text read as bytes (a vocabulary of 256). The first 90% of the bytes give the
  training windows and the last 10% the validation windows: T bytes each, side by side, with the
  next byte of each as its target.
- `F.npz`: `x_train` and `y_train` (and optionally `x_val`, `y_val`, `x_test`, `y_test`) as given.
- `synthetic`: seeded sequences of a Markov chain whose next token is, with probability 0.9, a
  fixed function of the last: learnable, so a loss curve means something.

Ids at or beyond the vocabulary, targets beyond the classes, and a length other than the network's
are refused on load with the file, the array and the row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from legion_nn.errors import LegionNNError
from runtime.dataset import Dataset, Split, npz_splits, read_npz

BYTES = 256
#: the share of a text kept for validation, from its end
VALIDATION_SHARE = 0.1


def windows(data: np.ndarray, length: int) -> Split:
    """Side-by-side windows of `length` tokens of `data`, each with the next token as target."""
    count = max(0, (len(data) - 1) // length)
    x = data[: count * length].reshape(count, length)
    y = data[1 : count * length + 1].reshape(count, length)
    return Split(x.astype(np.int32), y.astype(np.int32))


def from_text(path: str, length: int, vocab: int, classes: int) -> Dataset:
    if min(vocab, classes) < BYTES:
        raise LegionNNError(
            f"{path}: text is read as bytes, a vocabulary of {BYTES}, but the network reads "
            f"{vocab} token ids and scores {classes} classes"
        )
    try:
        data = np.frombuffer(Path(path).read_bytes(), np.uint8)
    except OSError as exc:
        raise LegionNNError(f"{path}: cannot read: {exc.strerror}") from None
    cut = len(data) - int(len(data) * VALIDATION_SHARE)
    train, val = windows(data[:cut], length), windows(data[cut:], length)
    if not len(train):
        raise LegionNNError(
            f"{path}: {len(data)} bytes make no training window of {length} tokens and a target"
        )
    empty = Split(np.zeros((0, length), np.int32), np.zeros((0, length), np.int32))
    return Dataset(Path(path).name, train, val, empty)


def _checked(path: str, name: str, a: np.ndarray, length: int, limit: int, what: str) -> np.ndarray:
    if not np.issubdtype(a.dtype, np.integer) or a.ndim != 2 or a.shape[1] != length:
        raise LegionNNError(
            f"{path}: {name} must be integers of shape (N, {length}), got {a.dtype} {list(a.shape)}"
        )
    bad = (a < 0) | (a >= limit)
    if bad.any():
        row, column = (int(i) for i in np.argwhere(bad)[0])
        raise LegionNNError(
            f"{path}: {name} row {row} holds {what} {int(a[row, column])} at position {column}, "
            f"outside [0, {limit})"
        )
    return a.astype(np.int32)


def from_npz(path: str, length: int, vocab: int, classes: int) -> Dataset:
    arrays = read_npz(path)
    if "x_train" not in arrays or "y_train" not in arrays:
        raise LegionNNError(
            f"{path}: a network of token ids needs arrays 'x_train' and 'y_train' (N, {length}); "
            f"has {sorted(arrays)}"
        )

    def read(part: str, x: np.ndarray, y: np.ndarray) -> Split:
        x = _checked(path, f"x_{part}", x, length, vocab, "token id")
        y = _checked(path, f"y_{part}", y, length, classes, "target")
        if len(x) != len(y):
            raise LegionNNError(f"{path}: x_{part} has {len(x)} rows but y_{part} has {len(y)}")
        return Split(x, y)

    empty = Split(np.zeros((0, length), np.int32), np.zeros((0, length), np.int32))
    return npz_splits(path, arrays, read, empty)


def synthetic(length: int, vocab: int, seed: int = 0, rows: int = 1200) -> Dataset:
    rng = np.random.default_rng(seed)
    successor = rng.permutation(vocab)
    tokens = np.empty((rows, length + 1), np.int64)
    tokens[:, 0] = rng.integers(0, vocab, rows)
    for t in range(length):
        follows = rng.random(rows) < 0.9
        tokens[:, t + 1] = np.where(follows, successor[tokens[:, t]], rng.integers(0, vocab, rows))
    x, y = tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)
    train, val = int(0.7 * rows), int(0.15 * rows)
    return Dataset(
        "synthetic",
        Split(x[:train], y[:train]),
        Split(x[train : train + val], y[train : train + val]),
        Split(x[train + val :], y[train + val :]),
    )


def load(source: str, length: int, vocab: int, classes: int, seed: int) -> Dataset:
    """The dataset `source` names for a network of `length` tokens, reading ids below `vocab`
    and scoring `classes`."""
    if source == "synthetic":
        return synthetic(length, min(vocab, classes), seed)
    if source.endswith(".npz"):
        return from_npz(source, length, vocab, classes)
    if source.endswith(".txt") or Path(source).is_file():
        return from_text(source, length, vocab, classes)
    raise LegionNNError(
        f"--data for a network of token ids must be synthetic, a .npz file or a text file, got "
        f"{source!r}"
    )
