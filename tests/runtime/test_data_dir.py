"""`--data DIR`: .npy files read in place, each rank reading only its rect of the batch, the next
batch read ahead; the same losses as the data in memory; bad files named in one line."""

from __future__ import annotations

import mmap
import subprocess
from pathlib import Path

import numpy as np
import pytest

from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network
from runtime import data
from runtime.data_dir import Batch, NpyFile, rect_reads
from runtime.rank_executor import RankExecutor
from runtime.training import TrainConfig, Trainer
from runtime.transport import run_threads
from tests.cli_in_process import run_in_process


def _write(directory: Path, dataset, parts=("train", "val")) -> Path:
    directory.mkdir(exist_ok=True)
    for part in parts:
        split = getattr(dataset, part)
        np.save(directory / f"x_{part}.npy", split.x)
        np.save(directory / f"y_{part}.npy", split.y.astype(np.int64))
    return directory


@pytest.fixture
def network():
    return load_network("seed-lcn-small")


@pytest.fixture
def in_memory(network):
    return data.synthetic(network.input, network.classes, seed=3, samples=120, dtype=np.float64)


def _config(network, dataset, **extra):
    return TrainConfig(network=network, dataset=dataset, batch=7, steps=14, dtype="float64",
                       seed=5, **extra)  # fmt: skip


def test_a_directory_read_in_place_trains_as_the_data_in_memory(tmp_path, network, in_memory):
    on_disk = data.load(str(_write(tmp_path / "d", in_memory)), network.input, network.classes,
                       0, np.float64)  # fmt: skip
    assert isinstance(on_disk.train.x, NpyFile) and len(on_disk.test) == 0
    expected = Trainer(_config(network, in_memory)).run()
    got = Trainer(_config(network, on_disk)).run()
    assert got.losses == expected.losses
    assert got.val_accuracy == expected.val_accuracy
    # 14 steps of 7 samples, each read once (read ahead or not), then the train accuracy's pass
    sample = in_memory.train.x[0].nbytes
    assert on_disk.train.x.bytes_read == (14 * 7 + len(in_memory.train)) * sample


def test_each_rank_reads_only_its_rect_and_the_split_equals_one_process(
    tmp_path, network, in_memory
):
    """4 ranks splitting the rows of the images: each reads its rows of pixels and the halo
    its first filter needs, not the batch, and the run equals one process."""
    directory = str(_write(tmp_path / "d", in_memory))
    expected = Trainer(_config(network, in_memory)).run()

    def body(transport):
        mine = data.load(directory, network.input, network.classes, 0, np.float64)
        cfg = _config(network, mine)
        executor = RankExecutor(transport, "spatial", seed=cfg.seed, stall_timeout=30)
        result = Trainer(cfg, executor=executor).run()
        return result.losses, mine.train.x.bytes_read

    ranks = run_threads(4, body)
    np.testing.assert_allclose(ranks[0][0], expected.losses, rtol=1e-9, atol=0)
    whole = (14 * 7 + len(in_memory.train)) * in_memory.train.x[0].nbytes
    read = [r[1] for r in ranks]
    assert all(0 < r < whole / 2 for r in read), read  # a quarter of the rows, and halos
    assert whole < sum(read) < 1.5 * whole  # the halos overlap


def test_a_batch_reads_ahead_what_the_last_batch_was_asked(tmp_path, in_memory, network):
    directory = _write(tmp_path / "d", in_memory)
    x = NpyFile(directory / "x_train.npy")
    first = Batch(x, np.array([3, 1, 4]))
    part = first[(slice(1, 3), slice(None), slice(2, 9), slice(None))]
    np.testing.assert_array_equal(part, in_memory.train.x[[1, 4], :, 2:9])
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        second = Batch(x, np.array([5, 9, 2]))
        second.prefetch(pool, first.asked)
        pool.submit(lambda: None).result()  # one worker: the read ahead is done
        read = x.bytes_read
        again = second[(slice(1, 3), slice(None), slice(2, 9), slice(None))]
        np.testing.assert_array_equal(again, in_memory.train.x[[9, 2], :, 2:9])
        assert x.bytes_read == read  # read ahead, not again


def _train(*args: str) -> subprocess.CompletedProcess:
    return run_in_process("train", "--steps", "1", "--batch", "4", "--no-progress", *args)


def _bad_dirs(root: Path, network, in_memory) -> list[tuple[Path, str]]:
    x, y = in_memory.train.x, in_memory.train.y.astype(np.int64)
    cases = {
        "shape": (x[:, :, :10], y, "samples of shape (1, 10, 20), the network takes (1, 20, 20)"),
        "labels": (x, np.where(np.arange(len(y)) == 5, 10, y),
                   "y_train.npy: target 10 of sample 5 is outside [0, 10)"),
        "lengths": (x, y[:-1], f"x_train.npy: {len(x)} samples, but y_train.npy has {len(y) - 1}"),
        "text": (np.array([["a"] * 4] * 3), y[:3], "x_train.npy: must hold real numbers, not <U1"),
        "float labels": (x, y.astype(np.float32),
                         ("y_train.npy: must hold integer targets of shape () per sample, not "
                          "float32 of ()")),
    }  # fmt: skip
    root.mkdir()
    out = []
    for name, (xs, ys, message) in cases.items():
        directory = root / name.replace(" ", "_")
        directory.mkdir()
        np.save(directory / "x_train.npy", xs)
        np.save(directory / "y_train.npy", ys)
        out.append((directory, message))
    objects = root / "objects"
    objects.mkdir()
    np.save(objects / "x_train.npy", np.array([{"a": 1}] * 3, dtype=object), allow_pickle=True)
    np.save(objects / "y_train.npy", y[:3])
    out.append((objects, "x_train.npy: must hold real numbers, not object"))
    missing = root / "missing"
    missing.mkdir()
    np.save(missing / "x_train.npy", x)
    out.append((missing, "y_train.npy: missing (--data DIR holds x_train.npy, y_train.npy)"))
    fortran = root / "fortran"
    fortran.mkdir()
    np.save(fortran / "x_train.npy", np.asfortranarray(x))
    np.save(fortran / "y_train.npy", y)
    out.append((fortran, "x_train.npy: is in Fortran order; save it C-ordered"))
    return out


def test_bad_directories_are_one_line_exit_2_and_nothing_written(tmp_path, network, in_memory):
    log = tmp_path / "log.jsonl"
    for directory, message in _bad_dirs(tmp_path / "bad", network, in_memory):
        with pytest.raises(LegionNNError, match="^" + str(directory)):
            data.load(str(directory), network.input, network.classes, 0, np.float32)
        result = _train("--data", str(directory), "--log-json", str(log))
        assert result.returncode == 2, directory
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"legion-nn train: {directory}/") and line.endswith(message), line
        assert not log.exists()


def test_token_ids_are_checked_as_they_are_read(tmp_path):
    network = load_network("token-mlp")
    (length,) = network.input
    rng = np.random.default_rng(0)
    x = rng.integers(0, network.vocab, (40, length))
    x[13, 2] = network.vocab + 5
    directory = tmp_path / "tokens"
    directory.mkdir()
    np.save(directory / "x_train.npy", x)
    np.save(directory / "y_train.npy", rng.integers(0, network.classes, (40, length)))
    dataset = data.load(str(directory), network.input, network.classes, 0, np.float32,
                        network.vocab)  # fmt: skip
    cfg = TrainConfig(network=network, dataset=dataset, batch=40, steps=1, shuffle=False)
    with pytest.raises(LegionNNError, match=r"x_train.npy: sample 13 holds an id outside \[0, "):
        Trainer(cfg).run()


@pytest.mark.parametrize(
    "sample, key",
    [
        ((3, 8, 8), (slice(None), slice(2, 5))),  # rows of every channel: a run per channel
        ((2, 64, 40), (slice(1, 2), slice(3, 60), slice(5, 9))),  # narrow columns: runs merged
        ((4, 300), (slice(0, 4), slice(0, 300))),  # the whole sample: read in place
        ((2, 1100), (slice(None), slice(1050, 1100))),  # ends more than a page apart
        ((5,), (slice(2, 2),)),  # empty
    ],
)
def test_a_rect_is_read_from_its_byte_ranges(tmp_path, sample, key):
    x = np.arange(3 * int(np.prod(sample)), dtype=np.float32).reshape(3, *sample)
    np.save(tmp_path / "x.npy", x)
    npy = NpyFile(tmp_path / "x.npy")
    np.testing.assert_array_equal(npy.read([2, 0], key), x[(np.array([2, 0]), *key)])
    assert npy.read([], key).shape == x[(np.array([], int), *key)].shape  # a piece of no rows
    reads = rect_reads(sample, key, 4)
    covered = sum(length for _, length in reads.extents)
    assert covered >= 4 * int(np.prod(reads.shape))  # every element is read...
    assert all(a[0] + a[1] <= b[0] for a, b in zip(reads.extents, reads.extents[1:]))
    gaps = [b[0] - a[0] - a[1] for a, b in zip(reads.extents, reads.extents[1:])]
    assert all(gap >= mmap.PAGESIZE for gap in gaps)  # ...in ranges a page or more apart
    assert (reads.gather is None) == (covered == 4 * int(np.prod(reads.shape)) and len(gaps) < 1)
