"""Benchmark tool: the saved runs of `legion-nn bench scaling --hosts H --json F` predicted again
by the cost model as it stands, each case from the machine file its own run measured, against
the steps that run measured.

    python bench/repredict.py RUN.json [RUN.json ...]

A change to the model is checked against runs, and one cluster variant's run takes 6 to 40
minutes of a machine that must do nothing else meanwhile; its measured steps do not depend on
the model, so a saved run checks a model change in seconds. Each row prints the measured step,
the prediction the run made and the one made now (`cluster_scaling.predict`, as `bench scaling`
makes it), the errors, and the run's kernel seconds a step over those predicted now
(`cluster_report.kernel_ratio`); the mean absolute error and the count within 15% close the table.
A change to the runtime, or to what `bench machine` measures, needs the runs made again. `auto`
searches again: where it now chooses other families than the run's, the row says so, and its
measured step is that of the plan chosen then. Strategy files named by a run must still be where
it read them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cluster_report import ONE_HOST, error_verdicts, kernel_ratio
from bench.cluster_scaling import CASE_KEYS, predict
from partitioner.machine_file import machine_from_json


def repredicted(run: dict, where: str) -> list[dict]:
    """Each measured row of `run` (a `bench scaling --json` report) with its prediction now."""
    machines = {tuple(m[k] for k in CASE_KEYS): m for m in run["machines"]}
    rows = []
    for row in run["results"]:
        if "measured_s" not in row:  # a job that failed
            continue
        saved = machines[tuple(row[k] for k in CASE_KEYS)]
        name = f"{where}: {row['variant']} {row['network']} b{row['batch']}"
        machine = machine_from_json({k: v for k, v in saved.items() if k not in CASE_KEYS}, name)
        strategy = "data" if row["strategy"] == ONE_HOST else row["strategy"]
        strategy = row.get("strategy_file", strategy)
        now = predict(row["network"], row["batch"], row["ranks"], strategy, machine)
        rows.append(
            row
            | {
                "error_then": row["predicted_s"] / row["measured_s"] - 1.0,
                "predicted_now_s": now["predicted_s"],
                "error_now": now["predicted_s"] / row["measured_s"] - 1.0,
                "auto_chose_now": now["auto_chose"],
                # the run's kernel seconds over those predicted now (None: not measured)
                "kernels_now": kernel_ratio(
                    row
                    | {
                        "predicted_s": now["predicted_s"],
                        "compute_fraction_predicted": now["compute_fraction_predicted"],
                    }
                ),
            }
        )
    return rows


def summary(errors: list[float]) -> str:
    verdicts = error_verdicts(errors)
    return (
        f"mean absolute error {100 * verdicts['mean_abs_error']:.1f}%, "
        f"{verdicts['within_15_percent']} of {verdicts['predictions']} within 15%"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="`bench scaling --hosts --json` reports")
    args = parser.parse_args(argv)
    rows = []
    for path in args.runs:
        rows += repredicted(json.loads(Path(path).read_text()), path)
    print(
        f"{'variant':12} {'network':16} {'batch':>5} {'strategy':14} {'measured':>9} "
        f"{'then':>9} {'now':>9} {'error then':>10} {'error now':>9} {'kernels':>7}"
    )
    for r in rows:
        moved = (
            f"  (auto chose {r['auto_chose_now']}, then {r['auto_chose']})"
            if r["auto_chose_now"] != r.get("auto_chose", "")
            else ""
        )
        print(
            f"{r['variant']:12} {r['network']:16} {r['batch']:5d} {r['strategy']:14} "
            f"{r['measured_s']:8.4f}s {r['predicted_s']:8.4f}s {r['predicted_now_s']:8.4f}s "
            f"{100 * r['error_then']:+9.1f}% {100 * r['error_now']:+8.1f}% "
            f"{'-' if r['kernels_now'] is None else format(r['kernels_now'], '7.2f')}{moved}"
        )
    print(f"then: {summary([r['error_then'] for r in rows])}")
    print(f"now:  {summary([r['error_now'] for r in rows])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
