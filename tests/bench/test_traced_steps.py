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
