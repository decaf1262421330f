"""Network spec files: JSON (or TOML) holding `name`, `input`, `classes` and `layers`.

Every problem is one line naming the file and, where the parser knows it, the line; layer problems
name the layer's index, kind and group. See docs/formats.md for the format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tomllib

from legion_nn.errors import LegionNNError, read_input
from legion_nn.layers.base import layer_from_spec
from legion_nn.network import Network

REQUIRED = ("input", "classes", "layers")


def parse_text(text: str, source: str, toml: bool = False) -> dict[str, Any]:
    if toml:
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise LegionNNError(f"{source}: not valid TOML: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LegionNNError(
            f"{source}:{exc.lineno}: not valid JSON: {exc.msg} (column {exc.colno})"
        ) from None
    if not isinstance(data, dict):
        raise LegionNNError(f"{source}:1: a network spec must be a JSON object")
    return data


def network_from_dict(data: dict[str, Any], source: str) -> Network:
    missing = [key for key in REQUIRED if key not in data]
    if missing:
        raise LegionNNError(
            f"{source}: the spec has no {missing[0]!r} (needs {', '.join(REQUIRED)})"
        )
    unknown = sorted(set(data) - set(REQUIRED) - {"name"})
    if unknown:
        raise LegionNNError(
            f"{source}: unknown key {unknown[0]!r} (allowed: name, {', '.join(REQUIRED)})"
        )
    layers_spec = data["layers"]
    if not isinstance(layers_spec, list) or not layers_spec:
        raise LegionNNError(f"{source}: 'layers' must be a non-empty list")
    layers = []
    for index, spec in enumerate(layers_spec):
        where = f"{source}: layers[{index}]"
        if isinstance(spec, dict) and spec.get("name"):
            where += f" ({spec.get('name')})"
        layers.append(layer_from_spec(spec, where))
    name = data.get("name") or Path(source).stem
    try:
        return Network(name, tuple(data["input"]), data["classes"], layers)
    except TypeError:
        raise LegionNNError(f"{source}: 'input' must be a list: [C, H, W] or [T]") from None
    except LegionNNError as exc:
        raise LegionNNError(f"{source}: {exc}") from None


def load_spec(path: str | Path) -> Network:
    path = Path(path)
    text = read_input(path)
    data = parse_text(text, str(path), toml=path.suffix.lower() == ".toml")
    return network_from_dict(data, str(path))
