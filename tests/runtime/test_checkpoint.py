"""Checkpoints every N steps, the newest K kept, and resuming from any of them exactly: the
losses and epoch records of an uninterrupted run, in float64, whatever the strategy, rank count
or pipeline stages of the run that wrote it."""

from __future__ import annotations

import io
import json
import os
import subprocess

import numpy as np
import pytest

from legion_nn.errors import LegionNNError
from runtime import checkpoint
from runtime.lr_schedule import LRSchedule
from runtime.rank_executor import RankExecutor
from runtime.training import Trainer
from runtime.transport import run_threads
from tests.cli_in_process import run_in_process
from tests.runtime.test_rank_executor import config, small_network

#: 120 synthetic samples, 84 of them training: an epoch is 12 steps of 7
OPTIONS = {
    "optimizer": "adam",
    "hyperparameters": {"lr": 0.01, "weight_decay": 0.01},
    "lr_schedule": LRSchedule("cosine", warmup_steps=3),
}


class Stop(Exception):
    """A run killed after some step."""


def _run(cfg, stop_after: int | None = None):
    """(losses, epoch records, resident tensors) of a run; with `stop_after`, the run dies once
    that many steps are done."""
    log = io.StringIO()

    def on_step(step, loss):
        if stop_after is not None and step + 1 == stop_after:
            raise Stop

    trainer = Trainer(cfg, log=log, on_step=on_step)
    try:
        result = trainer.run()
    except Stop:
        return None
    records = [json.loads(line) for line in log.getvalue().splitlines()]
    epochs = [r for r in records if r.get("event") == "epoch"]
    return result.losses, epochs, trainer.executor.resident()


def test_every_n_steps_the_newest_k_are_kept(tmp_path):
    cfg = config(small_network(), steps=20, checkpoint_dir=str(tmp_path), checkpoint_every=3,
                 keep=3, **OPTIONS)  # fmt: skip
    _run(cfg)
    # written after 3, 6, 9, 12 (an epoch too), 15, 18, and 20 (the end) steps
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["checkpoint-00000015.npz", "checkpoint-00000018.npz",
                     "checkpoint-00000020.npz", "checkpoint.npz"]  # fmt: skip
    assert os.readlink(tmp_path / "checkpoint.npz") == "checkpoint-00000020.npz"
    _, header = checkpoint.load(tmp_path, {})
    assert (header["step"], header["epoch"], header["batch_in_epoch"]) == (20, 1, 8)


@pytest.mark.parametrize("killed_after", [5, 13, 17])
def test_a_killed_run_resumed_from_its_newest_checkpoint_continues_exactly(tmp_path, killed_after):
    """Killed mid-epoch, just after an epoch's end, and in the second epoch; resumed from the newest
    checkpoint (after 3, 12 and 15 steps), the losses and the epoch records are the
    uninterrupted run's, bit for bit."""
    whole = _run(config(small_network(), steps=20, **OPTIONS))
    cfg = config(small_network(), steps=20, checkpoint_dir=str(tmp_path), checkpoint_every=3,
                 **OPTIONS)  # fmt: skip
    assert _run(cfg, stop_after=killed_after) is None
    done = {5: 3, 13: 12, 17: 15}[killed_after]
    assert checkpoint.load(tmp_path, {})[1]["step"] == done
    rest = _run(config(small_network(), steps=20, checkpoint_dir=str(tmp_path), resume=True,
                       **OPTIONS))  # fmt: skip
    assert rest[0] == whole[0][done:]
    assert rest[1] == [e for e in whole[1] if e["epoch"] >= done // 12]
    for name, value in whole[2].items():
        np.testing.assert_array_equal(rest[2][name], value)


def _ranks_checkpoint(cfg, nranks: int, strategy: str, stop_after: int) -> None:
    def body(transport):
        executor = RankExecutor(transport, strategy, seed=cfg.seed, stall_timeout=30)
        trainer = Trainer(cfg, executor=executor, on_step=on_step)
        try:
            trainer.run()
        except Stop:
            pass

    def on_step(step, loss):  # every rank stops after the same step
        if step + 1 == stop_after:
            raise Stop

    run_threads(nranks, body)


def test_a_checkpoint_of_a_pipeline_on_4_ranks_resumes_in_one_process(tmp_path):
    """Written by 2 stages of 2 ranks each, split by channels, in 4 micro-batches; resumed in
    one process, whole batches: the rest of the run is the uninterrupted one-process run's (to
    the order of sums, which micro-batches change)."""
    stages = config(small_network(), batch=8, steps=8, stages=2, micro_batches=4,
                    checkpoint_dir=str(tmp_path), checkpoint_every=4, **OPTIONS)  # fmt: skip
    _ranks_checkpoint(stages, 4, "model", stop_after=5)
    assert checkpoint.load(tmp_path, {})[1]["step"] == 4
    whole = _run(config(small_network(), batch=8, steps=8, **OPTIONS))
    rest = _run(config(small_network(), batch=8, steps=8, checkpoint_dir=str(tmp_path),
                       resume=True, **OPTIONS))  # fmt: skip
    np.testing.assert_allclose(rest[0], whole[0][4:], rtol=1e-9, atol=0)
    for name, value in whole[2].items():
        scale = max(np.abs(value).max(), 1e-30)
        assert np.abs(rest[2][name] - value).max() / scale < 1e-9, name


def test_a_v1_checkpoint_of_momentum_is_refused_and_others_resume(tmp_path):
    header = {"network": "n", "step": 1, "optimizer": "momentum"}
    checkpoint.save(tmp_path, {"w": np.zeros(2)}, header)
    path = tmp_path / "checkpoint-00000001.npz"
    with np.load(path) as archive:
        full = json.loads(bytes(archive["header"]).decode())
        arrays = {k: archive[k] for k in archive.files if k != "header"}
    full["format"] = "legion-nn/checkpoint-v1"
    np.savez(path, header=np.frombuffer(json.dumps(full).encode(), np.uint8), **arrays)
    with pytest.raises(LegionNNError, match="a momentum run's checkpoint of format .*v1"):
        checkpoint.load(tmp_path, {})
    full["optimizer"] = "adam"
    np.savez(path, header=np.frombuffer(json.dumps(full).encode(), np.uint8), **arrays)
    assert checkpoint.load(tmp_path, {})[1]["step"] == 1


def _train(*args: str) -> subprocess.CompletedProcess:
    return run_in_process("train", "--steps", "2", "--batch", "8", "--no-progress", *args)


def test_bad_checkpoint_input_gets_one_line_and_nothing_written(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    log = tmp_path / "log.jsonl"
    for args, message in [
        (["--checkpoint", str(afile)], f"--checkpoint {afile}: exists and is not a directory"),
        (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint DIR"),
        (["--checkpoint", str(tmp_path / "c"), "--checkpoint-every", "0"],
         "--checkpoint-every must be at least 1, got 0"),
        (["--checkpoint", str(tmp_path / "c"), "--keep", "0"], "--keep must be at least 1, got 0"),
    ]:  # fmt: skip
        result = _train(*args, "--log-json", str(log))
        assert result.returncode == 2, args
        assert result.stderr.strip().splitlines() == [f"legion-nn train: {message}"]
        assert not log.exists() and not (tmp_path / "c").exists()
    assert afile.read_text() == "x"


def test_a_checkpoint_of_another_network_is_refused(tmp_path):
    written = _train("--checkpoint", str(tmp_path / "c"))
    assert written.returncode == 0, written.stderr
    result = _train("three-layer-convnet", "--checkpoint", str(tmp_path / "c"), "--resume")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "checkpoint is for network='seed-lcn-small', this run has network=" in line


def test_a_fresh_run_into_another_runs_checkpoints_is_refused(tmp_path):
    """Its checkpoints would interleave with the old ones by step, and a resume could pick an
    old one: refused before anything is written, unless it resumes."""
    assert _train("--checkpoint", str(tmp_path / "c")).returncode == 0
    log = tmp_path / "log.jsonl"
    result = _train("--checkpoint", str(tmp_path / "c"), "--log-json", str(log))
    assert result.returncode == 2 and not log.exists()
    (line,) = result.stderr.strip().splitlines()
    assert line.endswith("holds another run's checkpoints: --resume continues from the newest, "
                         "or give an empty directory")  # fmt: skip
    resumed = _train("--checkpoint", str(tmp_path / "c"), "--resume", "--steps", "3",
                     "--log-json", str(log))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {"event": "resume", "step": 2} in records
    assert [r["step"] for r in records if "loss" in r] == [2]
