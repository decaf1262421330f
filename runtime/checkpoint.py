"""Checkpoints: atomic, versioned, checksummed, and independent of how a run was partitioned.

A checkpoint is one `.npz` file, `DIR/checkpoint.npz`, written to a temporary file and renamed. It
holds every resident tensor (parameters, optimizer state, running statistics) whole, in the
logical layout, so a run on R ranks can resume on R' ranks; and a JSON header with the format
version, what the run was (network fingerprint, dtype, optimizer, batch, data, seed), where it was
(step, epoch) and a SHA-256 over the arrays. Loading checks all of it and refuses a checkpoint
that is corrupt or belongs to another run, with one line saying which.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from legion_nn.atomic import write_bytes
from legion_nn.errors import LegionNNError

FORMAT = "legion-nn/checkpoint-v1"
FILENAME = "checkpoint.npz"
#: header fields that must match for a checkpoint to continue a run
IDENTITY = ("network", "fingerprint", "dtype", "optimizer", "batch", "data", "seed")


def checksum(arrays: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(name.encode())
        digest.update(str(array.dtype).encode())
        digest.update(str(array.shape).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def save(directory: str | Path, arrays: dict[str, np.ndarray], header: dict[str, Any]) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    full = {**header, "format": FORMAT, "checksum": checksum(arrays), "tensors": sorted(arrays)}
    buffer = io.BytesIO()
    payload = {f"t{i}": arrays[name] for i, name in enumerate(sorted(arrays))}
    np.savez(buffer, header=np.frombuffer(json.dumps(full).encode(), dtype=np.uint8), **payload)
    path = directory / FILENAME
    write_bytes(path, buffer.getvalue())
    return path


def load(directory: str | Path, expected: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and header of `DIR/checkpoint.npz`, after checking it continues `expected`."""
    path = Path(directory) / FILENAME
    if not path.exists():
        raise LegionNNError(f"{path}: no checkpoint to resume from")
    try:
        with np.load(path, allow_pickle=False) as data:
            header = json.loads(bytes(data["header"]).decode())
            names = header["tensors"]
            arrays = {name: data[f"t{i}"] for i, name in enumerate(names)}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError, EOFError):
        raise LegionNNError(f"{path}: corrupt checkpoint (cannot be read)") from None
    if header.get("format") != FORMAT:
        raise LegionNNError(
            f"{path}: unsupported checkpoint format {header.get('format')!r} (want {FORMAT})"
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
