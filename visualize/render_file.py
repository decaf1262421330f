"""Writing a rendering to a file, atomically: `.dot` as source; `.svg`, `.png`, `.pdf` via `dot`;
a matplotlib figure (`--plot F`) as `.png`, `.svg` or `.pdf`.

The format is the output's suffix. Graphviz's `dot` program lays the drawing out; where it is
missing the `.dot` source is still written beside the requested file, so nothing is lost, and the
error says how to install Graphviz and finish the job by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from legion_nn.atomic import write_bytes, write_text
from legion_nn.errors import LegionNNError

if TYPE_CHECKING:
    import graphviz

FORMATS = ("svg", "png", "pdf", "dot")
PLOT_FORMATS = ("png", "pdf", "svg")
INSTALL_HINT = "install Graphviz (apt-get install graphviz, brew install graphviz)"


class DotMissing(LegionNNError):
    """Graphviz's `dot` is not on PATH; the `.dot` source was written instead."""


def check_output(path: str | Path, formats: tuple[str, ...] = FORMATS, flag: str = "-o") -> str:
    """The format `path`'s suffix names, after checking it can be written there: one-line errors."""
    path = Path(path)
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in formats:
        raise LegionNNError(
            f"{flag} {path}: unknown format; give a file ending in "
            + ", ".join(f".{f}" for f in formats)
        )
    if not path.parent.is_dir():
        raise LegionNNError(f"{flag} {path}: no such directory {path.parent}")
    return suffix


def write_rendering(digraph: graphviz.Digraph, path: str | Path) -> Path:
    """Write `digraph` to `path` in the format its suffix names; returns the path written."""
    import graphviz

    path = Path(path)
    fmt = check_output(path)
    if fmt == "dot":
        write_text(path, digraph.source)
        return path
    try:
        data = digraph.pipe(format=fmt, quiet=True)
    except graphviz.ExecutableNotFound:
        source = path.with_suffix(".dot")
        write_text(source, digraph.source)
        raise DotMissing(
            f"Graphviz's dot is not on PATH: wrote {source} instead of {path}; {INSTALL_HINT}, "
            f"then run: dot -T{fmt} {source} -o {path}"
        ) from None
    except graphviz.CalledProcessError as exc:
        stderr = (exc.stderr or b"").decode(errors="replace").split()
        raise LegionNNError(
            f"dot failed (exit {exc.returncode}) drawing {path}: {' '.join(stderr)}"
        ) from None
    write_bytes(path, data)
    return path


def check_plot(path: str | Path) -> str:
    """The figure format `--plot PATH`'s suffix names, after checking it can be written there."""
    return check_output(path, PLOT_FORMATS, "--plot")


def write_figure(figure, path: str | Path, dpi: int = 110) -> None:
    """Write a matplotlib `figure` to `path` in the format its suffix names (`check_plot`)."""
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format=check_plot(path), dpi=dpi)
    write_bytes(path, buffer.getvalue())
