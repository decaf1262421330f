"""The clusters and cases `legion-nn bench scaling --hosts` runs (`bench.cluster_scaling`): a
sweep of link rates (`--link`, `link_sweep`), or a matrix of cluster variants built the ways real
clusters differ (shaping, burst, offloads, cores and ranks per host) crossed with networks at
their batch and link (`--matrix F|default`, `read_matrix`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from legion_nn.errors import LegionNNError
from legion_nn.networks import load_network
from runtime import cluster_links


@dataclass(frozen=True)
class Case:
    """A network at a batch; on `link` unless the variant gives every case its own."""

    network: str
    batch: int
    link: str | None = None


@dataclass(frozen=True)
class Variant:
    """One way of building the cluster: its links and cores (`cluster_links.LinkOptions`), ranks
    per host, and a link for every case (None: each case's own)."""

    name: str
    options: cluster_links.LinkOptions = field(default_factory=cluster_links.LinkOptions)
    ranks_per_host: int = 1
    link: str | None = None


#: the cases and variants of `--matrix default`: the three networks the cost model is held to
#: (a small and a large locally connected network, and a deep MLP of few large GEMMs), each on
#: the link it was held to, on clusters built the ways real ones differ
DEFAULT_MATRIX_CASES = (
    Case("seed-lcn-small", 64, "1gbit"),
    Case("seed-lcn", 16, "unlimited"),
    Case("deep-mlp", 128, "1gbit"),
)
DEFAULT_MATRIX_VARIANTS = (
    Variant("tbf-both"),
    Variant("nic-egress", cluster_links.LinkOptions("egress", 256 * 1024, True)),
    Variant("unshaped", link="unlimited"),
    Variant("2-per-host", ranks_per_host=2),
)
DEFAULT_MATRIX_STRATEGIES = ("data", "model", "spatial", "auto", "data+sharded")
_VARIANT_KEYS = {"name", "shaping", "burst", "offload", "cores_per_host", "ranks_per_host", "link"}
_CASE_KEYS = {"network", "batch", "link"}


def link_sweep(links: Sequence[str], cases: Sequence[tuple[str, int]]) -> tuple[list, list]:
    """(variants, cases) of `--link R1,R2,...`: the default cluster at each rate."""
    return [Variant(link, link=link) for link in links], [Case(n, b) for n, b in cases]


def read_matrix(path: str) -> tuple[list[Variant], list[Case], list[str] | None]:
    """(variants, cases, strategies or None) of a matrix file, or of `default`:

        {"variants": [{"name": "nic", "shaping": "egress", "burst": "256k", "offload": "on",
                       "cores_per_host": 1, "ranks_per_host": 2, "link": "unlimited"}, ...],
         "cases": [{"network": "seed-lcn", "batch": 16, "link": "3gbit"}, ...],
         "strategies": ["data", "model", "auto"]}

    Every variant runs every case; a variant's `link` replaces each case's, and its shaping
    and burst apply where a link is limited (its offloads and cores everywhere). A key that is
    unknown, a value that is wrong or options that contradict each other are one line naming
    the file and the entry."""
    if path == "default":
        return (
            list(DEFAULT_MATRIX_VARIANTS),
            list(DEFAULT_MATRIX_CASES),
            list(DEFAULT_MATRIX_STRATEGIES),
        )
    where = f"--matrix {path}"
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise LegionNNError(f"{where}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise LegionNNError(f"{where}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or not data.get("variants") or not data.get("cases"):
        raise LegionNNError(f'{where}: a matrix is {{"variants": [...], "cases": [...]}}')
    variants, cases = [], []
    for index, entry in enumerate(data["variants"]):
        at = f"{where}: variants[{index}]"
        if not isinstance(entry, dict) or "name" not in entry:
            raise LegionNNError(f"{at}: an object with a name")
        unknown = sorted(set(entry) - _VARIANT_KEYS)
        if unknown:
            raise LegionNNError(f"{at}: unknown key {unknown[0]!r}; keys: "
                                f"{', '.join(sorted(_VARIANT_KEYS))}")  # fmt: skip
        link = entry.get("link")
        bits = cluster_links.parse_rate(str(link)) if link is not None else 1.0
        per_host = entry.get("ranks_per_host", 1)
        if isinstance(per_host, bool) or not isinstance(per_host, int) or per_host < 1:
            raise LegionNNError(f"{at}: ranks_per_host must be a positive integer")
        try:
            options = cluster_links.link_options(
                bits, entry.get("shaping"),
                None if entry.get("burst") is None else str(entry["burst"]),
                entry.get("offload"), entry.get("cores_per_host"),
            )  # fmt: skip
        except LegionNNError as exc:
            raise LegionNNError(f"{at}: {exc}") from None
        variants.append(Variant(str(entry["name"]), options, per_host, link))
    for index, entry in enumerate(data["cases"]):
        at = f"{where}: cases[{index}]"
        if not isinstance(entry, dict) or not {"network", "batch"} <= set(entry):
            raise LegionNNError(f"{at}: an object with a network and a batch")
        unknown = sorted(set(entry) - _CASE_KEYS)
        if unknown:
            raise LegionNNError(f"{at}: unknown key {unknown[0]!r}")
        batch = entry["batch"]
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise LegionNNError(f"{at}: batch must be a positive integer")
        try:
            load_network(str(entry["network"]))
            if entry.get("link") is not None:
                cluster_links.parse_rate(str(entry["link"]))
        except LegionNNError as exc:
            raise LegionNNError(f"{at}: {exc}") from None
        cases.append(Case(str(entry["network"]), batch, entry.get("link")))
    for variant in variants:
        for case in cases:
            if (variant.link or case.link) is None:
                raise LegionNNError(
                    f"{where}: {case.network} has no link in variant {variant.name}"
                )
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise LegionNNError(f"{where}: two variants are named alike")
    strategies = data.get("strategies")
    if strategies is not None and (
        not isinstance(strategies, list) or not all(isinstance(s, str) for s in strategies)
    ):
        raise LegionNNError(f"{where}: strategies must be a list of names and files")
    return variants, cases, strategies
