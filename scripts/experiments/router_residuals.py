"""Where a router's speedup model is wrong, with its acceptance inputs right: for every collected row
of a drafter, the speedup the router's rule predicts from the row's own measured acceptance at the
collected K (what train-router's "hindsight acceptance" policy feeds it) against the row's measured
speedup, by family and drafter, and how the error follows the prompt's length.

    python scripts/experiments/router_residuals.py --router runs/workload-int8/router/router.pt \\
        --rows runs/workload-int8/rows-trainval.jsonl

The router's model prices a call as ``committed_tokens(a, K, fill) / (K c + v)`` (``routing.cost_model``):
no prefill, and one fill per drafter. Measured speedups are whole requests, prefill included, so a
long prompt dilutes every drafter's speedup and a draft model also pays its own prefill; and a host
drafter's fill differs by family. A residual (measured - predicted) that follows the prompt's length
or the family, not noise, is what the model lacks. Prints one markdown table (mean residual per
family and drafter, with the family's mean prompt tokens) and each drafter's correlation between
residual and prompt tokens; then each drafter's fill per family (``routing.cost_model.measured_fill`` over
the family's rows: the share of its slots it filled, against the one fill the router had).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routing.cost_model import measured_fill, speedup_model  # noqa: E402
from routing.router import NONE, Router  # noqa: E402
from routing.rows import read_rows  # noqa: E402
from serving.engine.goodput import per_token_acceptance  # noqa: E402


def predicted(router: Router, draft: str, rate: float, k: int) -> float:
    """The rule's speedup for ``draft`` at measured acceptance ``rate`` and K = ``k``, batch of one."""
    c = router.costs[draft]
    a = per_token_acceptance(torch.tensor([rate]), int(router.info.get("collected_k") or k))
    kt = torch.tensor([float(k)])
    return float(speedup_model(a, kt, c["draft_cost"], c["verify_cost"] + router.cost_model.verify_shift(kt, 1), c.get("fill", 1.0)))


def correlation(xs: list[float], ys: list[float]) -> float:
    """Pearson's r, NaN where either side is constant (or has one value)."""
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:
        return float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", required=True)
    ap.add_argument("--rows", required=True, nargs="+", help="collected rows (greedy)")
    args = ap.parse_args(argv)
    router = Router.load(args.router, device="cpu")
    cells: dict[tuple[str, str], list[tuple[int, float, float]]] = collections.defaultdict(list)
    fills: dict[tuple[str, str], tuple[list[float], list[float], int]] = collections.defaultdict(lambda: ([], [], 0))
    for path in args.rows:
        for row in read_rows(path):
            if row["draft"] == NONE or row["draft"] not in router.costs or row.get("mode", "greedy") != "greedy":
                continue
            guess = predicted(router, row["draft"], float(row["acceptance_rate"]), int(row["k"]))
            cells[(row["domain"], row["draft"])].append((int(row["prompt_tokens"]), float(row["speedup"]), guess))
            if row.get("target_calls") and row.get("mean_accepted_length") is not None:
                rates, extra, _ = fills[(row["domain"], row["draft"])]
                rates.append(float(row["acceptance_rate"]))
                extra.append(float(row["mean_accepted_length"]) - 1)
                fills[(row["domain"], row["draft"])] = (rates, extra, int(row["k"]))
    if not cells:
        raise SystemExit(f"no greedy drafting rows of the router's drafters ({', '.join(router.costs)}) in {args.rows}")
    drafts = sorted({d for _, d in cells})
    families = sorted({f for f, _ in cells})
    lines = ["| family | prompt tokens | " + " | ".join(f"{d} measured / predicted / residual" for d in drafts) + " |",
             "|---" * (len(drafts) + 2) + "|"]  # fmt: skip
    for f in families:
        lengths = [n for d in drafts for n, _, _ in cells.get((f, d), [])]
        parts = []
        for d in drafts:
            v = cells.get((f, d), [])
            if not v:
                parts.append("-")
                continue
            m, p = statistics.fmean(s for _, s, _ in v), statistics.fmean(g for _, _, g in v)
            parts.append(f"{m:.2f} / {p:.2f} / {m - p:+.2f}")
        lines.append(f"| {f} | {statistics.fmean(lengths):.0f} | " + " | ".join(parts) + " |")
    print("\n".join(lines))
    for d in drafts:
        v = [x for f in families for x in cells.get((f, d), [])]
        r = correlation([n for n, _, _ in v], [s - g for _, s, g in v])
        print(f"{d}: {len(v)} rows, correlation of residual with prompt tokens {r:+.2f}")
    if fills:
        print("\n| family | " + " | ".join(f"{d} fill" for d in drafts) + " |\n" + "|---" * (len(drafts) + 1) + "|")
        for f in families:
            parts = [f"{measured_fill(*fills[(f, d)]):.2f}" if (f, d) in fills else "-" for d in drafts]
            print(f"| {f} | " + " | ".join(parts) + " |")
        print("| the router's one fill | " + " | ".join(f"{router.costs[d].get('fill', 1.0):.2f}" for d in drafts) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
