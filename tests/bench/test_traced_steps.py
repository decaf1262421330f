"""The traced one-rank trainings `bench machine` times: the data they read."""

import numpy as np

from bench.traced_steps import samples_read
from legion_nn.networks import load_network
from runtime import data


def test_a_timed_training_reads_its_steps_samples_and_a_batch_of_each_split():
    network = load_network("seed-lcn-small")
    cut = samples_read(network, batch=4, steps=3)
    whole = data.load("synthetic", network.input, network.classes, 0, np.float32)
    # the steps' samples, in the order training takes them, and a batch for each evaluation
    assert (len(cut.train), len(cut.val), len(cut.test)) == (12, 4, 4)
    for part in ("train", "val", "test"):
        got, full = getattr(cut, part), getattr(whole, part)
        np.testing.assert_array_equal(got.x, full.x[: len(got)])
        np.testing.assert_array_equal(got.y, full.y[: len(got)])
    # a training longer than the set keeps it whole
    longer = samples_read(network, batch=64, steps=100)
    assert len(longer.train) == len(whole.train)


def _fake_trainings(monkeypatch, step_seconds):
    """`traced_training` replaced by one whose runs take `step_seconds` in turn; the steps each
    run was given are recorded."""
    from bench import traced_steps
    from bench.jobs import Job

    given = []
    times = iter(step_seconds)

    def traced(network, batch, micro_batches=1, steps=12, schedule="1f1b"):
        given.append(steps)
        return Job(network, batch, 1, "data", next(times), 0, {"run": len(given)})

    monkeypatch.setattr(traced_steps, "traced_training", traced)
    return given


def test_a_calibration_is_timed_as_a_measured_job(monkeypatch):
    """A step too short to time `MIN_TIMED_S` in the given steps has them raised, and that first
    run is discarded; of the runs kept, the one of least median step is the calibration's."""
    from bench.jobs import MIN_TIMED_S, WARMUP
    from bench.traced_steps import timed_training

    given = _fake_trainings(monkeypatch, [0.010, 0.009, 0.008])
    job = timed_training("seed-lcn-small", 64, steps=12, runs=2)
    raised = WARMUP + int(np.ceil(MIN_TIMED_S / 0.010))
    assert given == [12, raised, raised]
    assert (job.step_seconds, job.trace["run"]) == (0.008, 3)
    assert (raised - WARMUP) * 0.010 >= MIN_TIMED_S


def test_a_calibration_long_enough_keeps_its_first_run(monkeypatch):
    from bench.traced_steps import timed_training

    given = _fake_trainings(monkeypatch, [0.5, 0.6])
    job = timed_training("deep-mlp", 128, steps=12, runs=2)
    assert given == [12, 12]
    assert (job.step_seconds, job.trace["run"]) == (0.5, 1)


def test_a_calibration_times_a_run_before_and_after_the_work_between(monkeypatch):
    """The runs are apart in time: one before `between` (the profiling), the others after, so
    that one slow stretch of the machine cannot take them all."""
    from bench.traced_steps import timed_training

    given = _fake_trainings(monkeypatch, [0.010, 0.012, 0.009, 0.011])
    order = []
    job = timed_training("seed-lcn-small", 64, runs=3, between=lambda: order.append(len(given)))
    assert order == [2]  # the probe, discarded as too short, and one run before
    assert len(given) == 4 and (job.step_seconds, job.trace["run"]) == (0.009, 3)
