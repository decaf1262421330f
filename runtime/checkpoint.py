"""Checkpoints: atomic, versioned, checksummed, and independent of how a run was partitioned.

A checkpoint is one `.npz` file, `DIR/checkpoint-<step>.npz` (the steps done, 8 digits), written to
a temporary file and renamed, so a run killed at any moment leaves every checkpoint whole;
`DIR/checkpoint.npz` is a link to the newest, and the oldest beyond the newest `keep` are removed
after each write. A checkpoint holds every resident tensor (parameters, optimizer state, running
statistics) whole, in the logical layout, so a run on R ranks, in any strategy or pipeline stage
count, resumes on any other; and a JSON header with the format version, what the run was (network
fingerprint, dtype, optimizer, batch, data, seed), where it was (steps done, which fixes the
schedule's step and the data order's position) and a SHA-256 over the arrays. Loading checks all
of it and refuses a checkpoint that is corrupt or belongs to another run, with one line saying
which.

Format v2 keeps momentum's buffer as PyTorch does (b = μ·b + g, `runtime.kernels.update`); v1
kept v = μ·v − lr·g, so a v1 checkpoint of a momentum run is refused (any other v1 resumes).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from legion_nn.atomic import write_bytes
from legion_nn.errors import LegionNNError

FORMAT = "legion-nn/checkpoint-v2"
#: formats read, the current last
FORMATS = ("legion-nn/checkpoint-v1", FORMAT)
#: the link to the newest checkpoint (the one file of format v1's directories)
FILENAME = "checkpoint.npz"
NUMBERED = re.compile(r"checkpoint-(\d{8})\.npz")
#: header fields that must match for a checkpoint to continue a run
IDENTITY = ("network", "fingerprint", "dtype", "optimizer", "batch", "data", "seed")
#: checkpoints kept by default (`train --keep`)
KEEP = 2


def check_directory(directory: str | Path, resume: bool) -> None:
    """Refuse, before any training, a checkpoint directory that cannot be one, and a fresh run
    into one holding another run's checkpoints (whose numbering it would interleave)."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise LegionNNError(f"--checkpoint {directory}: exists and is not a directory")
    if not resume and newest(directory).exists():
        raise LegionNNError(
            f"--checkpoint {directory} holds another run's checkpoints: --resume continues "
            "from the newest, or give an empty directory"
        )


def numbered(directory: str | Path) -> list[Path]:
    """The checkpoints of `directory`, oldest first."""
    try:
        names = [e.name for e in os.scandir(directory)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [Path(directory) / n for n in sorted(n for n in names if NUMBERED.fullmatch(n))]


def newest(directory: str | Path) -> Path:
    """The newest checkpoint of `directory` (format v1's single file where there is no other)."""
    found = numbered(directory)
    return found[-1] if found else Path(directory) / FILENAME


def checksum(arrays: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(name.encode())
        digest.update(str(array.dtype).encode())
        digest.update(str(array.shape).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def save(
    directory: str | Path, arrays: dict[str, np.ndarray], header: dict[str, Any], keep: int = KEEP
) -> Path:
    """Write the checkpoint of `header["step"]` steps done, point the link at it, and remove
    the oldest beyond `keep`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    full = {**header, "format": FORMAT, "checksum": checksum(arrays), "tensors": sorted(arrays)}
    buffer = io.BytesIO()
    payload = {f"t{i}": arrays[name] for i, name in enumerate(sorted(arrays))}
    np.savez(buffer, header=np.frombuffer(json.dumps(full).encode(), dtype=np.uint8), **payload)
    path = directory / f"checkpoint-{int(header['step']):08d}.npz"
    write_bytes(path, buffer.getvalue())
    link = directory / FILENAME
    partial = directory / f".{FILENAME}.{os.getpid()}.link"
    partial.unlink(missing_ok=True)
    partial.symlink_to(path.name)
    partial.replace(link)  # a v1 file of that name is replaced too: its run continues here
    for old in numbered(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load(directory: str | Path, expected: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and header of `DIR`'s newest checkpoint, after checking it continues
    `expected`."""
    path = newest(directory)
    if not path.exists():
        raise LegionNNError(f"{path}: no checkpoint to resume from")
    try:
        with np.load(path, allow_pickle=False) as data:
            header = json.loads(bytes(data["header"]).decode())
            names = header["tensors"]
            arrays = {name: data[f"t{i}"] for i, name in enumerate(names)}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError, EOFError):
        raise LegionNNError(f"{path}: corrupt checkpoint (cannot be read)") from None
    if header.get("format") not in FORMATS:
        raise LegionNNError(
            f"{path}: unsupported checkpoint format {header.get('format')!r} (want {FORMAT})"
        )
    if header["format"] != FORMAT and header.get("optimizer") == "momentum":
        raise LegionNNError(
            f"{path}: a momentum run's checkpoint of format {header['format']}, whose velocity "
            "is not the buffer momentum keeps now (b = mu*b + g): it cannot resume"
        )
    if checksum(arrays) != header.get("checksum"):
        raise LegionNNError(f"{path}: corrupt checkpoint (checksum mismatch)")
    for key in IDENTITY:
        if key in expected and header.get(key) != expected[key]:
            raise LegionNNError(
                f"{path}: checkpoint is for {key}={header.get(key)!r}, this run has "
                f"{key}={expected[key]!r}"
            )
    return arrays, header
