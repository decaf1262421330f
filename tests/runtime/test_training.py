"""Training: the overfit check of seed 002, exact resume, checkpoints that refuse bad input."""

import json

import numba
import numpy as np
import pytest

from cli.main import main
from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network
from runtime import checkpoint, data
from runtime.dataset import Split
from runtime.training import TrainConfig, Trainer


def config(network="seed-lcn-small", source="synthetic", **overrides):
    net = load_network(network)
    dtype = np.float64 if overrides.get("dtype") == "float64" else np.float32
    dataset = data.load(source, net.input, net.classes, 0, dtype)
    return TrainConfig(network=net, dataset=dataset, **overrides)


def test_overfit_100_examples():
    # Seed 002: a three-layer convnet trained on 100 examples reaches >= 0.9 training accuracy.
    cfg = config(
        "three-layer-convnet",
        "digits",
        batch=50,
        epochs=15,
        optimizer="adam",
        hyperparameters={"lr": 1e-3},
    )
    cfg.dataset.train = Split(cfg.dataset.train.x[:100], cfg.dataset.train.y[:100])
    cfg.dataset.val = Split(cfg.dataset.val.x[:50], cfg.dataset.val.y[:50])
    cfg.dataset.test = Split(cfg.dataset.test.x[:50], cfg.dataset.test.y[:50])
    result = Trainer(cfg).run()
    assert result.train_accuracy >= 0.9, result.train_accuracy
    assert result.losses[-1] < result.losses[0]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_resume_reproduces_the_uninterrupted_losses(tmp_path, optimizer):
    whole = Trainer(config(batch=64, steps=10, optimizer=optimizer, dtype="float64")).run()
    first = Trainer(
        config(
            batch=64, steps=4, optimizer=optimizer, dtype="float64", checkpoint_dir=str(tmp_path)
        )
    ).run()
    rest = Trainer(
        config(
            batch=64,
            steps=10,
            optimizer=optimizer,
            dtype="float64",
            checkpoint_dir=str(tmp_path),
            resume=True,
        )
    ).run()
    assert first.losses + rest.losses == whole.losses
    assert rest.test_accuracy == whole.test_accuracy


def test_checkpoint_refuses_corruption_and_other_runs(tmp_path):
    Trainer(config(batch=64, steps=2, checkpoint_dir=str(tmp_path))).run()
    with pytest.raises(
        LegionNNError, match="checkpoint is for optimizer='adam', this run has optimizer='sgd'"
    ):
        Trainer(
            config(batch=64, steps=4, optimizer="sgd", checkpoint_dir=str(tmp_path), resume=True)
        ).run()
    with pytest.raises(LegionNNError, match="checkpoint is for batch=64, this run has batch=32"):
        Trainer(config(batch=32, steps=4, checkpoint_dir=str(tmp_path), resume=True)).run()
    path = tmp_path / checkpoint.FILENAME
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(LegionNNError, match="corrupt checkpoint"):
        Trainer(config(batch=64, steps=4, checkpoint_dir=str(tmp_path), resume=True)).run()


def test_checksum_detects_a_changed_value(tmp_path):
    arrays = {"w": np.arange(6.0).reshape(2, 3)}
    checkpoint.save(tmp_path, arrays, {"network": "n", "step": 1})
    loaded, header = checkpoint.load(tmp_path, {"network": "n"})
    np.testing.assert_array_equal(loaded["w"], arrays["w"])
    assert header["step"] == 1 and header["format"] == checkpoint.FORMAT
    assert checkpoint.checksum({"w": arrays["w"] + 1e-12}) != header["checksum"]


def test_train_cli_writes_the_log(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    code = main(
        [
            "train",
            "seed-lcn-small",
            "--data",
            "synthetic",
            "--steps",
            "3",
            "--batch",
            "16",
            "--log-json",
            str(log),
            "--no-progress",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all({"step", "epoch", "loss", "rank", "seconds"} <= set(r) for r in steps)
    done = records[-1]
    assert done["event"] == "done"
    # the same run through the Python API (adam, seed 0: train's defaults) gives the same numbers
    cfg = config(batch=16, steps=3)
    result = Trainer(cfg).run()
    assert [r["loss"] for r in steps] == pytest.approx(result.losses, rel=1e-5)  # float32
    assert done["test_accuracy"] == pytest.approx(result.test_accuracy, abs=1e-12)
    assert done["val_accuracy"] == pytest.approx(result.val_accuracy, abs=1e-12)
    correct = done["test_accuracy"] * len(cfg.dataset.test)  # a count of examples
    assert correct == pytest.approx(round(correct), abs=1e-9)
    assert "test accuracy" in capsys.readouterr().out


def test_npz_data(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "d.npz"
    np.savez(path, x=rng.random((30, 12, 12)), y=rng.integers(0, 10, 30))
    net = load_network("seed-lcn-small")
    dataset = data.load(str(path), net.input, net.classes, 0, np.float32)
    assert dataset.train.x.shape[1:] == (1, 20, 20)
    assert len(dataset.train) + len(dataset.val) + len(dataset.test) == 30
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=rng.random((30, 12, 12)), y=rng.integers(0, 99, 30))
    with pytest.raises(LegionNNError, match=r"labels y must be integers in \[0, 10\)"):
        data.load(str(bad), net.input, net.classes, 0, np.float32)


def test_npz_splits_are_used_as_given_and_no_shuffle_takes_batches_in_order(tmp_path):
    rng = np.random.default_rng(1)
    net = load_network("seed-lcn-small")
    x_train, x_test = rng.random((9, 1, 20, 20)), rng.random((4, 1, 20, 20))
    y_train, y_test = np.arange(9) % 10, np.arange(4)
    path = tmp_path / "given.npz"
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    dataset = data.load(str(path), net.input, net.classes, 0, np.float64)
    np.testing.assert_array_equal(dataset.train.x, x_train)  # in order, not split or permuted
    np.testing.assert_array_equal(dataset.train.y, y_train)
    np.testing.assert_array_equal(dataset.test.y, y_test)
    assert len(dataset.val) == 0  # a split the file lacks is empty
    config = TrainConfig(network=net, dataset=dataset, batch=4, steps=3, shuffle=False)
    trainer = Trainer(config)
    assert [trainer.batch_indices(s).tolist() for s in range(4)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8],
        [0, 1, 2, 3],  # the next epoch starts again
    ]
    shuffled = Trainer(TrainConfig(network=net, dataset=dataset, batch=4, steps=3))
    assert shuffled.batch_indices(0).tolist() != [0, 1, 2, 3]
    assert trainer.identity()["shuffle"] is False and "shuffle" not in shuffled.identity()
    log = tmp_path / "log.jsonl"
    args = ["--data", str(path), "--steps", "2", "--batch", "4", "--no-shuffle", "--no-progress"]
    assert main(["train", *args, "--log-json", str(log)]) == 0
    done = json.loads(log.read_text().splitlines()[-1])
    assert done["val_accuracy"] is None and done["test_accuracy"] is not None  # no val split
    half = tmp_path / "half.npz"
    np.savez(half, x_train=x_train, y_train=y_train, x_val=x_test)
    with pytest.raises(LegionNNError, match="half.npz: has 'x_val' but not 'y_val'"):
        data.load(str(half), net.input, net.classes, 0, np.float64)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ["train", "--data", "nope"],
            "--data must be digits, synthetic, a .npz file or a directory",
        ),
        (["train", "--batch", "0"], "--batch must be at least 1"),
        (["train", "--steps", "0"], "--steps must be at least 1"),
        (["train", "--resume"], "--resume needs --checkpoint DIR"),
        (["train", "--batch", "4", "--micro-batches", "5"], "--micro-batches 5 is larger"),
    ],
)
def test_train_cli_bad_input(args, fragment, capsys):
    assert main(args + ["--no-progress"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1


def test_a_network_with_batchnorm_and_dropout_trains_in_one_process():
    from tests.runtime.test_executor import MIXED

    dataset = data.load("synthetic", MIXED.input, MIXED.classes, 0, np.float64)
    cfg = TrainConfig(network=MIXED, dataset=dataset, batch=8, steps=6, dtype="float64")
    trainer = Trainer(cfg)
    result = trainer.run()
    assert len(result.losses) == 6 and all(np.isfinite(result.losses))
    running = trainer.executor.resident()["bn0.running"]
    assert not np.allclose(running[0], 0.0) and not np.allclose(running[1], 1.0)


@pytest.mark.parametrize("steps", [7, 6])
def test_a_configs_evaluation_batches_are_the_forward_passes_its_run_makes(steps):
    """7 steps of 3 a epoch end the third epoch early (its validation once, at the last step),
    6 end the second on its last step (once, not twice)."""
    cfg = config(batch=4, steps=steps)
    cfg.dataset.train = Split(cfg.dataset.train.x[:10], cfg.dataset.train.y[:10])
    cfg.dataset.val = Split(cfg.dataset.val.x[:5], cfg.dataset.val.y[:5])
    cfg.dataset.test = Split(cfg.dataset.test.x[:3], cfg.dataset.test.y[:3])
    trainer = Trainer(cfg)
    passes = []
    run_inference = trainer.executor.run_inference

    def counted(graph, ctx):
        passes.append(len(ctx.inputs))
        return run_inference(graph, ctx)

    trainer.executor.run_inference = counted
    trainer.run()
    epochs = -(-steps // 3)
    assert cfg.evaluation_batches == len(passes) == (epochs + 1) * 2 + 1 + 3


def test_a_run_without_evaluation_makes_no_forward_pass_beyond_its_steps(tmp_path, capsys):
    """`--no-evaluation` (a run timing its steps): the same steps, no inference pass, and the
    log's accuracy and loss fields null."""
    cfg = config(batch=4, steps=4)
    cfg.dataset.train = Split(cfg.dataset.train.x[:8], cfg.dataset.train.y[:8])
    cfg.evaluation = False
    trainer = Trainer(cfg)

    def refused(graph, ctx):
        raise AssertionError("an evaluation ran")

    trainer.executor.run_inference = refused
    result = trainer.run()
    assert cfg.evaluation_batches == 0
    assert np.isnan([result.val_accuracy, result.test_accuracy, result.train_accuracy]).all()
    again = config(batch=4, steps=4)
    again.dataset.train = cfg.dataset.train
    assert result.losses == Trainer(again).run().losses  # the same steps, evaluated or not
    log = tmp_path / "log.jsonl"
    argv = ["train", "seed-lcn-small", "--data", "synthetic", "--steps", "2", "--batch", "16"]
    assert main([*argv, "--log-json", str(log), "--no-progress", "--no-evaluation"]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    epoch, done = records[-2], records[-1]
    assert epoch["event"] == "epoch" and epoch["val_loss"] is None
    assert epoch["train_loss"] is not None
    assert done["event"] == "done" and done["steps"] == 2
    assert all(done[k] is None for k in ("test_accuracy", "val_accuracy", "train_accuracy"))
    out = capsys.readouterr().out
    assert "(no evaluation)" in out and "val loss" not in out


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="Numba has one thread here")
@pytest.mark.parametrize(
    ("steps", "environment", "threads"),
    [(2, None, 1), (10**8, None, 2), (2, "2", 2)],
)
def test_a_run_in_one_process_chooses_its_threads_before_compiling(
    monkeypatch, steps, environment, threads
):
    """Two steps of seed-lcn-small would not repay compiling its parallel loops, a hundred
    million would; `NUMBA_NUM_THREADS` in the environment is left as it says."""
    from cli.commands.train import _compile_ahead

    if environment is None:
        monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("NUMBA_NUM_THREADS", environment)
    compiled = []
    monkeypatch.setattr(
        "runtime.compile_ahead.compile_ahead", lambda *args, **kw: compiled.append(args[0])
    )
    cfg = config(batch=8, steps=steps)
    trainer = Trainer(cfg)
    graph = trainer.graph(8)
    prepared = trainer.executor.prepare(graph)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        _compile_ahead("float32", 0, 1, None, helpers=False, alone=cfg)(graph, prepared)
        assert numba.get_num_threads() == threads
    finally:
        numba.set_num_threads(before)
    assert compiled and "filter.untied" in compiled[0]


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="Numba has one thread here")
def test_a_train_command_compiles_for_the_threads_it_chose_and_leaves_them_as_it_found_them(
    monkeypatch, capsys
):
    import runtime.compile_ahead

    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    seen = []
    compile_ahead = runtime.compile_ahead.compile_ahead

    def recorded(*args, **kwargs):
        seen.append(numba.get_num_threads())
        return compile_ahead(*args, **kwargs)

    monkeypatch.setattr(runtime.compile_ahead, "compile_ahead", recorded)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        args = ["train", "--data", "synthetic", "--steps", "2", "--batch", "8", "--no-progress"]
        assert main(args) == 0
        assert seen == [1]  # two steps of seed-lcn-small: its plain loops
        assert numba.get_num_threads() == 2
    finally:
        numba.set_num_threads(before)
