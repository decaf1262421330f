"""`--data DIR`: a training set as large as the disk, read in place.

DIR holds `x_train.npy` and `y_train.npy`, and optionally `x_val.npy`/`y_val.npy` and
`x_test.npy`/`y_test.npy`. The samples x are mapped, never loaded: the region model applied to
I/O. A step's batch is a `Batch`, the rows of the step's indices, and the data task of each rank
takes from it only the rect of the input its pieces need (`runtime.adapters.elementwise._data`):
its rows under data parallelism, its rows and the halos of its pixels under spatial splits. The
elements of that rect are copied out of the mapping, and its pages are given back at once
(`MADV_DONTNEED`), so a rank holds the batch's rect it reads, not the file: the mapped pages of
a file a process has read count in its resident set until it unmaps them.

Targets y are small (a label, or a row of token targets, per sample) and are read whole, which
lets their range be checked on open. Samples must match the network's input exactly: nothing is
resized, since that would read the whole file.

A `Prefetcher` reads the rects the rank asked for in one step for the next step's rows, in a
thread, while the step runs (the kernels release the GIL). The order of the samples is the
trainer's seeded permutation of indices, so the data is never copied whole.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from numpy.lib import format as npy_format

from legion_nn.errors import LegionNNError
from runtime.dataset import PARTS, Dataset, Split

#: the slices of one sample a data task asks for (the batch dim's slice apart)
SampleKey = tuple[slice, ...]
#: what `np.save` writes: 1.0, or 2.0 for a header over 64 KiB
HEADER_READERS = {
    (1, 0): npy_format.read_array_header_1_0,
    (2, 0): npy_format.read_array_header_2_0,
}


class MappedArray:
    """An `.npy` file's array, mapped read-only; `read` copies out rects of chosen rows."""

    def __init__(self, path: Path, bound: int | None = None) -> None:
        self.path = path
        #: ids must lie in [0, bound) (token ids, checked as they are read)
        self.bound = bound
        try:
            with open(path, "rb") as handle:
                version = npy_format.read_magic(handle)
                header = HEADER_READERS.get(version)
                if header is None:
                    raise ValueError(f"format version {version} is not read here")
                shape, fortran, dtype = header(handle)
                offset = handle.tell()
        except (OSError, ValueError) as exc:
            raise LegionNNError(f"{path}: cannot read as .npy: {exc}") from None
        if dtype.hasobject or not (
            np.issubdtype(dtype, np.number) and not np.issubdtype(dtype, np.complexfloating)
        ):
            raise LegionNNError(f"{path}: must hold real numbers, not {dtype}")
        if fortran and len(shape) > 1:
            raise LegionNNError(f"{path}: is in Fortran order; save it C-ordered")
        if not shape:
            raise LegionNNError(f"{path}: holds a scalar, not samples")
        self.shape, self.dtype = tuple(shape), dtype
        self.sample_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        self.offset = offset
        size = offset + shape[0] * self.sample_bytes
        if os.path.getsize(path) < size:
            raise LegionNNError(f"{path}: is cut short ({os.path.getsize(path)} of {size} bytes)")
        with open(path, "rb") as handle:  # (never empty: it holds its header)
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        # Samples are read in a shuffled order: a fault reads its pages, not the kernel's
        # read-around of 32 pages about it, which would be 10 times the bytes of a 12 KiB
        # sample, through the page cache
        self._map.madvise(mmap.MADV_RANDOM)
        self.array = np.ndarray(self.shape, dtype, buffer=self._map, offset=offset)
        #: bytes copied out so far (what the runs' I/O checks read)
        self.bytes_read = 0

    def __len__(self) -> int:
        return self.shape[0]

    def whole(self) -> np.ndarray:
        """Every sample, read into memory (small arrays: the targets)."""
        return np.array(self.array)

    def read(self, rows: Sequence[int], key: SampleKey) -> np.ndarray:
        """The rect `key` of each of `rows`' samples, in that order, in the file's dtype."""
        inner = self.array[(0, *key)] if len(self) else np.zeros(0)
        out = np.empty((len(rows), *inner.shape), self.dtype)
        page = mmap.PAGESIZE
        for i, row in enumerate(rows):
            out[i] = self.array[(int(row), *key)]
            start = self.offset + int(row) * self.sample_bytes
            lo = start - start % page
            self._map.madvise(mmap.MADV_DONTNEED, lo, start + self.sample_bytes - lo)
        self.bytes_read += out.nbytes
        if self.bound is not None and out.size and (out.min() < 0 or out.max() >= self.bound):
            i = int(np.flatnonzero(((out < 0) | (out >= self.bound)).any(
                axis=tuple(range(1, out.ndim))))[0])  # fmt: skip
            raise LegionNNError(
                f"{self.path}: sample {int(rows[i])} holds an id outside [0, {self.bound})"
            )
        return out


class Batch:
    """A step's samples (`rows` of `source`), read rect by rect as the data task asks."""

    def __init__(self, source: MappedArray, rows: np.ndarray) -> None:
        self.source, self.rows = source, np.asarray(rows)
        self.shape = (len(self.rows), *source.shape[1:])
        #: the keys asked for, in order (what the next step's prefetch reads)
        self.asked: list[tuple[slice, SampleKey]] = []
        self._ready: Future | None = None
        self._ready_keys: list[tuple[slice, SampleKey]] = []

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key) -> np.ndarray:
        key = key if isinstance(key, tuple) else (key,)
        batch_rows, sample = key[0], tuple(key[1:])
        self.asked.append((batch_rows, sample))
        if self._ready is not None and (batch_rows, sample) in self._ready_keys:
            return self._ready.result()[self._ready_keys.index((batch_rows, sample))]
        return self.source.read(self.rows[batch_rows], sample)

    def prefetch(self, pool: ThreadPoolExecutor, keys: list[tuple[slice, SampleKey]]) -> None:
        """Start reading `keys` (another batch's `asked`) in `pool`."""
        self._ready_keys = list(keys)
        self._ready = pool.submit(
            lambda: [self.source.read(self.rows[rows], sample) for rows, sample in keys]
        )


class Prefetcher:
    """Batches of a mapped split, each read ahead with the keys its predecessor was asked."""

    def __init__(self, source: MappedArray) -> None:
        self.source = source
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="legion-nn-prefetch")
        self._keys: dict[int, list[tuple[slice, SampleKey]]] = {}
        self._ahead: dict[int, Batch] = {}

    def batch(self, step: int, rows: np.ndarray) -> Batch:
        """Step `step`'s batch: the one read ahead for it, if its rows are those."""
        ahead = self._ahead.pop(step, None)
        if ahead is not None and np.array_equal(ahead.rows, rows):
            return ahead
        return Batch(self.source, rows)

    def read_ahead(self, step: int, rows: np.ndarray, after: Batch) -> None:
        """Start reading step `step`'s batch of `rows`, with what `after` was asked for when
        it had as many rows (the same program: the same rects)."""
        if after.asked:
            # (slices are not hashable before Python 3.12: no dict or set of them)
            self._keys[len(after)] = [
                k for i, k in enumerate(after.asked) if k not in after.asked[:i]
            ]
        keys = self._keys.get(len(rows))
        if keys:
            batch = Batch(self.source, rows)
            batch.prefetch(self.pool, keys)
            self._ahead = {step: batch}

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def load_dir(
    directory: str,
    shape: tuple[int, ...],
    label_shape: tuple[int, ...],
    classes: int,
    vocab: int | None = None,
) -> Dataset:
    """The dataset of `directory`'s .npy files for a network of per-sample input `shape` (token
    ids below `vocab`, where given), whose targets are `label_shape` per sample (() for a label)
    in [0, classes)."""
    root = Path(directory)
    splits = {}
    for part in PARTS:
        x_path, y_path = root / f"x_{part}.npy", root / f"y_{part}.npy"
        if not x_path.exists() and not y_path.exists() and part != "train":
            splits[part] = Split(np.zeros((0, *shape)), np.zeros((0, *label_shape), np.int32))
            continue
        for path in (x_path, y_path):
            if not path.is_file():
                raise LegionNNError(
                    f"{path}: missing (--data DIR holds x_{part}.npy, y_{part}.npy)"
                )
        x, y = MappedArray(x_path, vocab), MappedArray(y_path)
        if x.shape[1:] != tuple(shape):
            raise LegionNNError(
                f"{x_path}: samples of shape {x.shape[1:]}, the network takes {tuple(shape)}"
            )
        if len(y) != len(x):
            raise LegionNNError(f"{x_path}: {len(x)} samples, but {y_path.name} has {len(y)}")
        if y.shape[1:] != tuple(label_shape) or not np.issubdtype(y.dtype, np.integer):
            raise LegionNNError(
                f"{y_path}: must hold integer targets of shape {tuple(label_shape)} per sample, "
                f"not {y.dtype} of {y.shape[1:]}"
            )
        labels = y.whole()
        if labels.size and (labels.min() < 0 or labels.max() >= classes):
            bad = int(np.flatnonzero((labels < 0) | (labels >= classes))[0])
            raise LegionNNError(
                f"{y_path}: target {labels.reshape(-1)[bad]} of sample "
                f"{bad // max(1, int(np.prod(label_shape)))} is outside [0, {classes})"
            )
        splits[part] = Split(x, labels.astype(np.int32))
    if not len(splits["train"]):
        raise LegionNNError(f"{root / 'x_train.npy'}: has no samples")
    return Dataset(root.name or str(root), splits["train"], splits["val"], splits["test"])
