"""Make `tests/fixtures/digits_cnn.onnx`: a digits-sized CNN built and exported by PyTorch.

    pip install torch && python bench/export_digits_cnn.py [--out tests/fixtures/digits_cnn.onnx]

The network (1×8×8 in, 10 classes): Conv 3×3 (16) → ReLU → MaxPool 2 → Conv 3×3 (32) → ReLU →
MaxPool 2 → Flatten → Linear 128→64 → ReLU → Linear 64→10, the logits its output. Its
parameters are PyTorch's default initialisation under a fixed seed, untrained: `legion-nn train
MODEL.onnx` starts from them, as training in PyTorch would. The batch dim is dynamic. The file is
committed, so the tests need no PyTorch; this script remakes it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.torch_export import export

SEED = 20261125


def model(torch):
    """The network, freshly initialised under `SEED`."""
    from torch import nn

    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 2 * 2, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    ).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "digits_cnn.onnx"))
    args = parser.parse_args(argv)
    return export(lambda torch: (model(torch), torch.zeros(1, 1, 8, 8)), "x", args.out)


if __name__ == "__main__":
    sys.exit(main())
