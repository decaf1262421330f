"""What a run of `bench scaling --hosts` says (`bench.cluster_scaling` runs it): each row's
error, how far its job's runs lie apart (the machine's noise for that job) and its kernel
seconds over predicted, per case whether the measured order of the strategies was predicted and
how far auto is from the best measured, and the table that prints them.
"""

from __future__ import annotations

from collections.abc import Sequence

#: the row of one rank on one host: the step data parallelism must beat to pay
ONE_HOST = "one host"


def _groups(rows: Sequence[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row.get("variant", row["link"]), row["network"], row["batch"], row["link"])
        groups.setdefault(key, []).append(row)
    return groups


def summarize(rows: Sequence[dict]) -> dict:
    """The matrix's verdicts: each prediction's error (mean and largest absolute, how many
    within 15%), and per case whether the measured order of the strategies was predicted
    (the one-host row and auto, which is one of the others, left out) and how far auto's
    measured step is from the best measured."""
    done = [r for r in rows if "measured_s" in r]
    errors = [r["error"] for r in done]
    cases = []
    for (variant, network, batch, link), group in _groups(done).items():
        fixed = [r for r in group if r["strategy"] not in ("auto", ONE_HOST)]
        measured = [r["strategy"] for r in sorted(fixed, key=lambda r: r["measured_s"])]
        predicted = [r["strategy"] for r in sorted(fixed, key=lambda r: r["predicted_s"])]
        pairs = [(a, b) for i, a in enumerate(fixed) for b in fixed[i + 1 :]]
        # a pair predicted alike (one plan under two names: data and spatial of an MLP) is
        # ordered either way
        agree = sum(
            a["predicted_s"] == b["predicted_s"]
            or (a["measured_s"] < b["measured_s"]) == (a["predicted_s"] < b["predicted_s"])
            for a, b in pairs
        )
        entry = {
            "variant": variant, "network": network, "batch": batch, "link": link,
            "measured_order": measured, "predicted_order": predicted,
            "order_predicted": agree == len(pairs),
            "pairs_ordered": f"{agree}/{len(pairs)}",
        }  # fmt: skip
        chosen = [r for r in group if r["strategy"] == "auto"]
        if fixed and chosen:
            best = min(fixed, key=lambda r: r["measured_s"])
            entry["auto_against_best"] = chosen[0]["measured_s"] / best["measured_s"] - 1.0
            entry["best"] = best["strategy"]
        cases.append(entry)
    spreads = sorted(s for r in done if (s := run_spread(r)) is not None)
    return error_verdicts(errors) | {
        "cases": cases,
        "median_run_spread": spreads[len(spreads) // 2] if spreads else None,
        "largest_run_spread": spreads[-1] if spreads else None,
    }


def error_verdicts(errors: Sequence[float]) -> dict:
    """How many predictions, their mean and largest absolute error, and how many within 15%
    (the cost model's goal), of `errors` (predicted over measured, less one; either sign)."""
    errors = [abs(e) for e in errors]
    return {
        "predictions": len(errors),
        "mean_abs_error": sum(errors) / len(errors) if errors else None,
        "max_abs_error": max(errors, default=None),
        "within_15_percent": sum(e <= 0.15 for e in errors),
    }


def _runs(row: dict) -> str:
    """A row's `run_spread` as the table prints it: "+12%", or "-" for one run."""
    spread = run_spread(row)
    return "-" if spread is None else f"+{spread:.0%}"


def _computing(row: dict) -> str:
    """The share of a step a rank computes, measured/predicted (`-` where either is unknown)."""
    measured, predicted = (
        row.get("compute_fraction_measured"),
        row.get("compute_fraction_predicted"),
    )
    if measured is None or predicted is None:
        return "-"
    return f"{measured:.0%}/{predicted:.0%}"


def kernel_ratio(row: dict) -> float | None:
    """A row's kernel seconds a step, measured over predicted (its computing shares times its
    steps); None where either share is unknown. Far from 1, the step's kernels ran other than
    the one-rank calibration (`Machine.compute_factor`) and the stack's CPU a byte price them."""
    measured, predicted = (
        row.get("compute_fraction_measured"),
        row.get("compute_fraction_predicted"),
    )
    if not measured or not predicted or "measured_s" not in row or not row["predicted_s"]:
        return None
    return measured * row["measured_s"] / (predicted * row["predicted_s"])


def _kernels(row: dict) -> str:
    ratio = kernel_ratio(row)
    return "-" if ratio is None else f"x{ratio:.2f}"


def _kernel_spread(rows: list[dict]) -> str | None:
    """The range of the rows' kernel ratios, one host apart from the rest."""
    parts = []
    for label, alone in (("one host", True), ("the rest", False)):
        found = sorted(
            r for row in rows if (row["strategy"] == ONE_HOST) == alone
            if (r := kernel_ratio(row)) is not None
        )  # fmt: skip
        if found:
            parts.append(f"{label} x{found[0]:.2f}-{found[-1]:.2f}")
    return f"kernels measured over predicted: {', '.join(parts)}" if parts else None


def run_spread(row: dict) -> float | None:
    """How far a row's runs lie apart: the slowest run's median step over the fastest's, less
    one (None where it kept fewer than two runs). The row's measured step is its fastest run;
    a prediction's error is read beside this, the machine's own noise for that job."""
    runs = row.get("measured_runs_s") or []
    if len(runs) < 2 or min(runs) <= 0:
        return None
    return max(runs) / min(runs) - 1.0


def _spread_line(summary: dict) -> str | None:
    """The summary's spread of the rows' runs (`run_spread`), where some row kept several."""
    if summary.get("largest_run_spread") is None:
        return None
    return (
        f"runs of one job apart by up to {summary['largest_run_spread']:.1%} (median "
        f"{summary['median_run_spread']:.1%}): the machine's noise beside each error"
    )


def format_table(report: dict) -> str:
    # a strategy file's stem, or a network's spec file, may be longer than the built-ins' names
    rows = report["results"]
    width = max([8, *(len(row["strategy"]) for row in rows)])
    wide = max([16, *(len(row["network"]) for row in rows)])
    vary = max([7, *(len(row.get("variant", "")) for row in rows)])
    spread = sorted({row["ranks"] for row in rows if row["strategy"] != ONE_HOST})
    lines = [
        f"{report['hosts']} emulated hosts, {'/'.join(map(str, spread)) or report['ranks']} ranks",
        (
            f"{'variant':{vary}s} {'link':>9s} {'network':{wide}s} {'batch':>5s} "
            f"{'strategy':{width}s} {'measured':>10s} {'predicted':>10s} {'error':>7s} "
            f"{'runs':>6s} {'computing':>9s} {'kernels':>7s} {'bytes/step':>14s}  auto chose"
        ),
    ]
    for row in rows:
        head = (
            f"{row.get('variant', row['link']):{vary}s} {row['link']:>9s} "
            f"{row['network']:{wide}s} {row['batch']:5d} {row['strategy']:{width}s}"
        )
        if "failed" in row:
            lines.append(f"{head} failed: {row['failed']}")
            continue
        lines.append(
            f"{head} {row['measured_s']:9.4f}s {row['predicted_s']:9.4f}s {row['error']:+7.1%} "
            f"{_runs(row):>6s} {_computing(row):>9s} {_kernels(row):>7s} "
            f"{row['bytes_per_step']:14,d}"
            f"  {row['auto_chose']}"
        )
    summary = report.get("summary") or summarize(rows)
    for case in summary["cases"]:
        where = f"{case['network']} at {case['link']}" + (
            f" ({case['variant']})" if case["variant"] != case["link"] else ""
        )
        order = "predicted" if case["order_predicted"] else "not predicted"
        line = (
            f"{where}: order {order} ({case['pairs_ordered']} pairs; measured "
            f"{' < '.join(case['measured_order'])})"
        )
        if "auto_against_best" in case:
            line += (
                f"; auto {case['auto_against_best']:+.1%} against the best measured "
                f"({case['best']})"
            )
        lines.append(line)
    kernels = _kernel_spread(rows)  # a failed row has no ratio
    if kernels:
        lines.append(kernels)
    if summary["predictions"]:
        lines.append(
            f"{summary['predictions']} predictions: mean absolute error "
            f"{summary['mean_abs_error']:.1%}, largest {summary['max_abs_error']:.1%}, "
            f"{summary['within_15_percent']} within 15%"
        )
    spread = _spread_line(summary)
    if spread:
        lines.append(spread)
    return "\n".join(lines) + "\n"
