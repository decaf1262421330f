"""`bench/threaded_twins.py` times real twins: every case names a kernel with both, and its call
runs that kernel."""

import numpy as np

from bench.threaded_twins import cases
from runtime.kernels.threaded import ThreadedKernel


def test_every_case_calls_a_kernel_with_twins(monkeypatch):
    for label, module, name, call in cases(np.random.default_rng(0)):
        kernel = getattr(module, name)
        assert isinstance(kernel, ThreadedKernel), label
        called = []

        def counted(*args, kernel=kernel, called=called):
            called.append(True)
            return kernel(*args)

        monkeypatch.setattr(module, name, counted)
        call()
        monkeypatch.setattr(module, name, kernel)
        assert called, label
