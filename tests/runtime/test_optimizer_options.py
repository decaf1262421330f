"""Optimizer options with PyTorch's semantics: weight decay (AdamW's decoupled, SGD's L2),
clipping by the norm over every parameter, learning-rate schedules with warm-up.

The oracle is PyTorch itself (`AdamW`, `SGD`, `clip_grad_norm_`, `LambdaLR`) on the twin of
`tests/fixtures/digits_cnn.onnx` that `bench/export_digits_cnn.py` builds, in float64: the
same arithmetic in another order, so parameters agree to some ulps of their size after three
steps (1e-9 is the issue's bound; the differences are ~1e-15). Split runs (threads and
`mpiexec`) must equal one process to the same bound, the norm being the whole model's on every
rank.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network
from runtime import data
from runtime.kernels.update import adam_step, momentum_step, sgd_step, squared_norm
from runtime.lr_schedule import LRSchedule
from runtime.rank_executor import RankExecutor
from runtime.training import TrainConfig, Trainer
from runtime.transport import run_threads
from tests.cli_in_process import run_in_process
from tests.paths import FIXTURES, ROOT
from tests.runtime.test_rank_executor import assert_same, config, local_run, small_network

CNN = FIXTURES / "digits_cnn.onnx"


# Schedules.


def test_cosine_with_warmup_is_the_issues_formula():
    schedule = LRSchedule("cosine", warmup_steps=3)
    total = 10
    for t in range(total):
        expected = (t + 1) / 3 if t < 3 else 0.5 * (1 + math.cos(math.pi * (t - 3) / (total - 3)))
        assert schedule.factor(t, total) == expected
    assert schedule.factor(3, total) == 1.0 and schedule.factor(9, total) < 0.06


def test_step_and_constant_schedules():
    step = LRSchedule("step", warmup_steps=2, step_size=3, gamma=0.5)
    assert [step.factor(t, 20) for t in range(9)] == [0.5, 1, 1, 1, 1, 0.5, 0.5, 0.5, 0.25]
    assert [LRSchedule().factor(t, 5) for t in range(5)] == [1.0] * 5
    assert [LRSchedule(warmup_steps=4).factor(t, 9) for t in range(5)] == [0.25, 0.5, 0.75, 1, 1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kind": "linear"}, "unknown schedule 'linear'"),
        ({"kind": "step"}, "--lr-schedule step needs --step-size N"),
        ({"kind": "step", "step_size": 0}, "--step-size must be at least 1"),
        ({"warmup_steps": -1}, "--warmup-steps must be 0 or more"),
        ({"gamma": 0.0}, "--gamma must be positive"),
    ],
)
def test_bad_schedules_are_named(options, message):
    with pytest.raises(LegionNNError, match=message):
        LRSchedule(**options)


# Kernels, against NumPy in float64.


def _arrays(count, shape=(4, 3, 5), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for _ in range(count)]


def test_adamw_decays_apart_and_takes_the_scaled_gradient():
    param, grad, m, v = _arrays(4)
    v = np.abs(v)
    p, mm, vv = param.copy(), m.copy(), v.copy()
    lr, b1, b2, eps, wd, scale, t = 0.01, 0.9, 0.999, 1e-8, 0.1, 0.3, 4
    p = p * (1 - lr * wd)
    g = scale * grad
    mm = b1 * mm + (1 - b1) * g
    vv = b2 * vv + (1 - b2) * g * g
    p = p - lr * (mm / (1 - b1**t)) / (np.sqrt(vv / (1 - b2**t)) + eps)
    adam_step(param, m, v, lr, b1, b2, eps, t, wd, scale).apply(grad)
    for got, want in ((param, p), (m, mm), (v, vv)):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)


def test_sgd_and_momentum_take_l2_decay_and_the_scaled_gradient():
    param, grad = _arrays(2)
    expected = param - 0.1 * (0.5 * grad + 0.01 * param)
    sgd_step(param, 0.1, 0.01, 0.5).apply(grad)
    np.testing.assert_allclose(param, expected, rtol=1e-14, atol=1e-15)
    param, grad, buffer = _arrays(3, seed=1)
    b = 0.9 * buffer + (0.5 * grad + 0.01 * param)
    expected = param - 0.1 * b
    momentum_step(param, buffer, 0.1, 0.9, 0.01, 0.5).apply(grad)
    np.testing.assert_allclose(buffer, b, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(param, expected, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_squared_norm_of_any_layout_in_float64(dtype):
    from runtime.kernels.update import CHUNK

    (a,) = _arrays(1, shape=(3, CHUNK // 2 + 5))
    a = a.astype(dtype)
    exact = float((a.astype(np.float64) ** 2).sum())
    # n float64 additions of non-negative terms: within n·eps of the sum
    bound = a.size * np.finfo(np.float64).eps * exact
    assert abs(squared_norm(a) - exact) <= bound
    strided = a[:, 7 : CHUNK // 4]
    assert abs(squared_norm(strided) - float((strided.astype(np.float64) ** 2).sum())) <= bound
    assert squared_norm(np.asfortranarray(a)) == pytest.approx(exact, rel=1e-12)


# The PyTorch oracle.


def _cnn_config(steps=3, **options) -> TrainConfig:
    network = load_network(str(CNN))
    dataset = data.digits(network.input, network.classes, np.float64)
    return TrainConfig(
        network=network,
        dataset=dataset,
        batch=16,
        steps=steps,
        dtype="float64",
        shuffle=False,
        **options,
    )


def _our_steps(cfg: TrainConfig):
    trainer = Trainer(cfg)
    trainer.executor.prepare(trainer.graph(cfg.batch))
    trainer.executor.load_resident(cfg.network.initial)
    start = {k: v.copy() for k, v in trainer.executor.resident().items()}
    losses = [trainer.step(step)[0] for step in range(cfg.steps)]
    return start, losses, trainer.executor.resident()


def _torch_twin(torch, start):
    """The exporter's model in float64, and for each of our parameters the PyTorch tensor it
    is, as our layout holds it (found by value: the fixture was exported from this model)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from export_digits_cnn import model

    twin = model(torch).double().train()
    ours = {}
    for name, value in start.items():
        if name not in {n for n in start if not n.endswith((".m", ".v", ".velocity"))}:
            continue
        found = [
            p for p in twin.parameters()
            if p.numel() == value.size and np.array_equal(
                p.detach().numpy().reshape(value.shape), value)
        ]  # fmt: skip
        assert len(found) == 1, name
        ours[name] = found[0]
    assert len(ours) == len(list(twin.parameters()))
    return twin, ours


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_three_steps_equal_pytorchs_optimizer_clipping_and_schedule(optimizer):
    """AdamW (or SGD with momentum and L2 decay) + clip_grad_norm_ + warm-up cosine LambdaLR:
    three float64 steps, every parameter within 1e-9 of PyTorch's. The clip is below the
    gradients' norm, so every step is clipped (asserted), and the learning rate of each step is
    the schedule's (asserted from the log)."""
    torch = pytest.importorskip("torch")
    lr, wd, clip = (0.01, 0.05, 0.2) if optimizer == "adam" else (0.1, 0.01, 0.2)
    schedule = LRSchedule("cosine", warmup_steps=2)
    hyper = {"lr": lr, "weight_decay": wd} | ({"momentum": 0.9} if optimizer == "momentum" else {})
    cfg = _cnn_config(
        optimizer=optimizer, hyperparameters=hyper, lr_schedule=schedule, clip_grad_norm=clip
    )
    start, losses, stepped = _our_steps(cfg)

    twin, ours = _torch_twin(torch, start)
    params = list(twin.parameters())
    if optimizer == "adam":
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    else:
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: schedule.factor(t, cfg.steps))
    theirs = []
    for step in range(cfg.steps):
        rows = slice(step * cfg.batch, (step + 1) * cfg.batch)
        x = torch.from_numpy(cfg.dataset.train.x[rows])
        y = torch.from_numpy(cfg.dataset.train.y[rows].astype(np.int64))
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(twin(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        assert norm.item() > clip  # every step is clipped
        opt.step()
        sched.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(losses, theirs, rtol=1e-9, atol=0)
    for name, param in ours.items():
        expected = param.detach().numpy().reshape(stepped[name].shape)
        scale = np.abs(expected).max()
        assert np.abs(stepped[name] - expected).max() <= 1e-9 * scale, name


# Split runs equal one process.


def _ranks_run(cfg: TrainConfig, nranks: int, strategy: str, steps: int = 3):
    def body(transport):
        executor = RankExecutor(
            transport, strategy, seed=cfg.seed, stall_timeout=30, clip_grad_norm=cfg.clip_grad_norm
        )
        trainer = Trainer(cfg, executor=executor)
        executor.prepare(trainer.graph(cfg.batch))
        losses, traffic, norms = [], [], []
        for step in range(steps):
            losses.append(trainer.step(step)[0])
            traffic.append((executor.last_bytes_sent, executor.last_bytes_planned))
            norms.append(executor.last_grad_norm)
        return losses, executor.resident(), traffic, norms

    return run_threads(nranks, body)


CLIPPED = {
    "optimizer": "adam",
    "hyperparameters": {"lr": 0.01, "weight_decay": 0.1},
    "lr_schedule": LRSchedule("cosine", warmup_steps=1),
    "clip_grad_norm": 0.05,
}


@pytest.mark.parametrize(("strategy", "nranks"), [("data", 2), ("model", 3), ("spatial", 2)])
def test_clipped_split_runs_equal_one_process(strategy, nranks):
    cfg = config(small_network(), **CLIPPED)
    local = local_run(cfg)
    ranks = _ranks_run(cfg, nranks, strategy)
    assert_same(local, [r[:3] for r in ranks])
    norms = [r[3] for r in ranks]
    assert all(n == norms[0] for n in norms)  # the same bits on every rank
    assert min(norms[0]) > CLIPPED["clip_grad_norm"]  # clipped at every step


def test_the_norm_counts_each_replicated_gradient_once():
    """Data-parallel ranks each hold every gradient whole: the norm over 2 ranks is the norm
    of one process, not √2 of it."""
    cfg = config(small_network(), **CLIPPED)
    trainer = Trainer(cfg)
    trainer.executor.prepare(trainer.graph(cfg.batch))
    trainer.step(0)
    one = trainer.executor.last_grad_norm
    norms = _ranks_run(cfg, 2, "data", steps=1)[0][3]
    assert norms[0] == pytest.approx(one, rel=1e-12)


def test_log_json_carries_the_learning_rate_and_the_norm(tmp_path):
    log = tmp_path / "log.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "cli", "train", "--steps", "4", "--batch", "8",
         "--no-progress", "--optimizer", "sgd", "--lr", "0.2", "--lr-schedule", "step",
         "--step-size", "2", "--gamma", "0.5", "--warmup-steps", "1", "--clip-grad-norm", "1",
         "--weight-decay", "0.01", "--log-json", str(log)],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    steps = [r for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]
    assert [r["lr"] for r in steps] == pytest.approx([0.2, 0.2, 0.2, 0.1])
    assert all(r["grad_norm"] > 0 for r in steps)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lr", "-1"], "--lr must be positive, got -1.0"),
        (["--weight-decay", "-0.1"], "--weight-decay must be 0 or more, got -0.1"),
        (["--clip-grad-norm", "0"], "--clip-grad-norm must be positive, got 0.0"),
        (["--clip-grad-norm", "-2"], "--clip-grad-norm must be positive, got -2.0"),
        (["--lr-schedule", "step"], "--lr-schedule step needs --step-size N"),
        (["--warmup-steps", "-3"], "--warmup-steps must be 0 or more, got -3"),
    ],
)
def test_bad_optimizer_flags_get_one_line_and_exit_2(flags, message, tmp_path):
    log = tmp_path / "log.jsonl"
    result = run_in_process(
        "train", "--steps", "1", "--no-progress", "--log-json", str(log), *flags
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"legion-nn train: {message}"]
    assert not log.exists()


def test_a_clipped_pipeline_equals_one_process():
    """Two stages of 4 micro-batches, each stage's ranks splitting its layers by channels: the
    norm adds up both stages' gradients (on different ranks), as one process's does."""
    local = local_run(config(small_network(), batch=8, micro_batches=4, **CLIPPED))
    cfg = config(small_network(), batch=8, stages=2, micro_batches=4, **CLIPPED)
    ranks = _ranks_run(cfg, 4, "model")
    assert_same(local, [r[:3] for r in ranks])
