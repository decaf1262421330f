"""`runtime.data.digits`: scikit-learn's digits read from the file it ships, without importing
scikit-learn, equal to what scikit-learn's own reader gives."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from runtime import data
from tests.paths import ROOT


def test_the_bundled_digits_equal_scikit_learns():
    from sklearn.datasets import load_digits

    images, labels = data.bundled_digits()
    expected = load_digits()
    np.testing.assert_array_equal(images, expected.images)
    np.testing.assert_array_equal(labels, expected.target)
    dataset = data.digits((1, 8, 8), 10)
    total = len(dataset.train.y) + len(dataset.val.y) + len(dataset.test.y)
    assert total == len(expected.target) == 1797
    assert 0.0 <= dataset.train.x.min() and dataset.train.x.max() <= 1.0


def test_loading_the_digits_does_not_import_scikit_learn():
    script = (
        "import sys; from runtime import data; data.digits((1, 8, 8), 10); "
        "print('sklearn' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
