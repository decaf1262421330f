"""The one exception type users see: its message is a single line naming the culprit."""

from __future__ import annotations

from pathlib import Path


class LegionNNError(Exception):
    """Bad input or a broken invariant; the CLI prints `legion-nn: <message>` and exits non-zero."""


class ShapeError(LegionNNError):
    """A layer cannot accept the shape it is given."""


class VerifyError(LegionNNError):
    """A task graph breaks one of the invariants checked by `verify`."""


def read_input(path: str | Path, binary: bool = False) -> str | bytes:
    """The contents of an input file, or a one-line error naming it and why it cannot be read."""
    path = Path(path)
    try:
        return path.read_bytes() if binary else path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LegionNNError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise LegionNNError(
            f"{path}: not UTF-8 text (byte {exc.start} is 0x{exc.object[exc.start]:02x})"
        ) from None
