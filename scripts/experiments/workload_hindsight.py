"""Two checks on a saved workload.json (``scripts/report.py --workload-router ... --workload-extra-k 8``):

    python scripts/experiments/workload_hindsight.py runs/report-workload-int8-s10/workload.json

1. The measurement's own error: on every prompt where the routed policy ran a single drafter at
   that drafter's own fixed K (the same work as the single policy), routed's tokens/s over the
   single policy's; identical work should give 1.
2. K in hindsight: the routed policy's mean speedup if each prompt on which it chose a model-free
   drafter (``ngram``, ``suffix``) had run that drafter at the longer fixed K instead (its
   ``NAME@K`` single policy's measurement), against the best single drafter and the oracle.
"""

from __future__ import annotations

import argparse
import json
import statistics

from serving.engine.engine_settings import HOST_DRAFTERS


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload_json")
    ap.add_argument("--policy", default="routed")
    args = ap.parse_args(argv)
    report = json.load(open(args.workload_json))
    rows, name, k = report["rows"], args.policy, report["config"]["k"]
    extra = report["config"].get("extra_k") or []

    def speed(row: dict, p: str) -> float:
        return row["tokens_per_s"][p] / row["tokens_per_s"]["none"]

    same = [row["tokens_per_s"][name] / row["tokens_per_s"][row["choice"][name]] for row in rows
            if row["choice"][name] in row["tokens_per_s"] and row["k"][name] == k and row["choice"][name] != "none"]  # fmt: skip
    if same:
        print(f"{name} over the same single policy at K = {k} (identical work), {len(same)} prompts: "
              f"mean {statistics.fmean(same):.3f}, median {statistics.median(same):.3f}, "
              f"range {min(same):.2f}-{max(same):.2f}")  # fmt: skip
    summary = report["summary"]["all"]
    best = summary["speedup"][summary["best_single"]]
    print(f"{name}: {summary['speedup'][name]:.3f}x; best single `{summary['best_single']}` {best:.3f}x; oracle {summary['oracle']:.3f}x")
    for kk in extra:
        alt = [speed(row, f"{row['choice'][name]}@{kk}") if row["choice"][name] in HOST_DRAFTERS else speed(row, name) for row in rows]
        mean = statistics.fmean(alt)
        print(f"{name} with its {'/'.join(HOST_DRAFTERS)} choices at K = {kk}: {mean:.3f}x, {mean / best:.3f} of the best single, "
              f"{mean / summary['oracle']:.3f} of the oracle")  # fmt: skip


if __name__ == "__main__":
    main()
