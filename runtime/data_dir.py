"""`--data DIR`: a training set as large as the disk, read in place.

DIR holds `x_train.npy` and `y_train.npy`, and optionally `x_val.npy`/`y_val.npy` and
`x_test.npy`/`y_test.npy`. The samples x are never loaded whole: the region model applied to
I/O. A step's batch is a `Batch`, the rows of the step's indices, and the data task of each rank
takes from it only the rect of the input its pieces need (`runtime.adapters.elementwise._data`):
its rows under data parallelism, its rows and the halos of its pixels under spatial splits.

A rect is read with positional reads (`os.preadv`) of the byte ranges it covers in each sample,
ranges less than a page apart read as one, straight into the batch where the rect is whole
samples. Two reasons not to read through a memory mapping: a page fault holds the GIL while the
disk answers, so a thread reading ahead through a mapping stalls the step's own thread (16% of
the step on a cold page cache), where `preadv` lets it go; and the pages of a mapping a process
has read count in its resident set until it unmaps them, where the page cache does not.

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
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RectReads:
    """How a rect of a sample is read: the byte ranges (`extents`: start in the sample, length)
    read one after the other into a buffer, and where each of the rect's elements lies in that
    buffer (`gather`; None where the buffer is the rect itself)."""

    shape: tuple[int, ...]
    extents: tuple[tuple[int, int], ...]
    gather: np.ndarray | None

    @property
    def buffer_bytes(self) -> int:
        return sum(length for _, length in self.extents)


def rect_reads(sample: tuple[int, ...], key: SampleKey, itemsize: int) -> RectReads:
    """The reads of rect `key` (unit-step slices, trailing dims whole where left out) of a
    C-ordered sample of shape `sample`: its contiguous runs of elements, merged where less than a
    page apart, since the disk reads whole pages anyway."""
    key = (*key, *(slice(None),) * (len(sample) - len(key)))
    ranges = [k.indices(n) for k, n in zip(key, sample)]
    if any(step != 1 for _, _, step in ranges):
        raise ValueError(f"rect {key} is not made of unit-step slices")
    strides = np.cumprod((*sample[1:], 1)[::-1])[::-1]
    shape = tuple(max(0, stop - start) for start, stop, _ in ranges)
    elements = np.zeros(shape, np.int64)
    for axis, ((start, stop, _), stride) in enumerate(zip(ranges, strides)):
        view = [1] * len(shape)
        view[axis] = shape[axis]
        elements += (np.arange(start, stop, dtype=np.int64) * stride).reshape(view)
    flat = elements.reshape(-1)
    if not flat.size:
        return RectReads(shape, (), None)
    page = max(1, mmap.PAGESIZE // itemsize)
    breaks = np.flatnonzero(np.diff(flat) > page) + 1  # already ascending: C order
    starts, ends = flat[np.r_[0, breaks]], flat[np.r_[breaks - 1, flat.size - 1]] + 1
    extents = tuple((int(a) * itemsize, int(b - a) * itemsize) for a, b in zip(starts, ends))
    if len(extents) == 1 and ends[0] - starts[0] == flat.size:
        return RectReads(shape, extents, None)
    offsets = np.r_[0, np.cumsum(ends - starts)[:-1]]
    extent = np.searchsorted(starts, flat, side="right") - 1
    return RectReads(shape, extents, flat - starts[extent] + offsets[extent])


class NpyFile:
    """An `.npy` file's array, read in place: `read` copies out rects of chosen rows."""

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
        self._fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)
        #: the reads of each rect asked for, by its (start, stop) pairs
        self._reads: dict[tuple, RectReads] = {}
        #: bytes copied out so far (what the runs' I/O checks read)
        self.bytes_read = 0

    def __len__(self) -> int:
        return self.shape[0]

    def whole(self) -> np.ndarray:
        """Every sample, read into memory (small arrays: the targets)."""
        out = np.empty(self.shape, self.dtype)
        self._read_into(out.reshape(-1).view(np.uint8), self.offset)
        return out

    def read(self, rows: Sequence[int], key: SampleKey) -> np.ndarray:
        """The rect `key` of each of `rows`' samples, in that order, in the file's dtype."""
        reads = self._rect_reads(key)
        out = np.empty((len(rows), *reads.shape), self.dtype)
        elements = int(np.prod(reads.shape, dtype=np.int64))
        if reads.gather is None:
            buffers = out.reshape(len(rows), elements).view(np.uint8)
        else:
            buffers = np.empty((len(rows), reads.buffer_bytes), np.uint8)
        starts = [self.offset + int(row) * self.sample_bytes for row in rows]
        for start in starts:  # the disk may then serve them in any order, all at once
            for at, length in reads.extents:
                os.posix_fadvise(self._fd, start + at, length, os.POSIX_FADV_WILLNEED)
        for buffer, start in zip(buffers, starts):
            done = 0
            for at, length in reads.extents:
                self._read_into(buffer[done : done + length], start + at)
                done += length
        if reads.gather is not None:
            np.take(
                buffers.view(self.dtype), reads.gather, axis=1, out=out.reshape(len(rows), elements)
            )
        self.bytes_read += out.nbytes
        if self.bound is not None and out.size and (out.min() < 0 or out.max() >= self.bound):
            i = int(np.flatnonzero(((out < 0) | (out >= self.bound)).any(
                axis=tuple(range(1, out.ndim))))[0])  # fmt: skip
            raise LegionNNError(
                f"{self.path}: sample {int(rows[i])} holds an id outside [0, {self.bound})"
            )
        return out

    def _rect_reads(self, key: SampleKey) -> RectReads:
        bounds = tuple(k.indices(n) for k, n in zip(key, self.shape[1:]))
        if bounds not in self._reads:
            self._reads[bounds] = rect_reads(self.shape[1:], key, self.dtype.itemsize)
        return self._reads[bounds]

    def _read_into(self, buffer: np.ndarray, position: int) -> None:
        """Fill `buffer` (bytes) from `position` of the file; `preadv` waits for the disk
        without the GIL."""
        done = 0
        while done < buffer.size:
            got = os.preadv(self._fd, [buffer[done:]], position + done)
            if got == 0:
                raise LegionNNError(f"{self.path}: ends early (was it changed while training?)")
            done += got


class Batch:
    """A step's samples (`rows` of `source`), read rect by rect as the data task asks."""

    def __init__(self, source: NpyFile, rows: np.ndarray) -> None:
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
    """Batches of a split read in place, each read ahead with the keys its predecessor was asked."""

    def __init__(self, source: NpyFile) -> None:
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
        x, y = NpyFile(x_path, vocab), NpyFile(y_path)
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
