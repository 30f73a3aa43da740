"""What rows at a second K say about the router's price of a longer K (issue 30, tenth session).

    python scripts/experiments/second_k_check.py --router runs/workload-int8/router-s10/router.pt \
        --rows runs/workload-int8/rows-trainval.jsonl --curve runs/workload-int8/rows-trainval-k8.jsonl

For each drafter collected at both K on the same (training) prompts, per family and overall:
the measured speedups at the collected K and at the second K, the router's predicted speedups at
both from the measured rates at the collected K, with its fitted verify-shift scale and without
it, and the draft tokens accepted per call at the second K, measured and as the geometric curve
predicts them from the collected K's rate and fill. Then the median verify step of each run
(``target_step_ms``) beside the target alone's one-token step in the same run, and the step
table's own ratio for a verify of K + 1 tokens. Reads rows only; prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections import defaultdict

import torch

from routing.dataset import read_collected
from routing.router import NONE, Router
from serving.engine.goodput import expected_tokens, per_token_acceptance, step_ms


def rows_of(path: str) -> dict[tuple[str, str], dict]:
    return {(r["prompt_id"], r["draft"]): r for r in read_collected([path], "greedy")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", required=True)
    ap.add_argument("--rows", required=True, help="rows at the collected K")
    ap.add_argument("--curve", required=True, help="rows of some drafters at a second K, same prompts")
    args = ap.parse_args(argv)
    router = Router.load(args.router)
    at_k, curve = rows_of(args.rows), rows_of(args.curve)
    k2 = {int(r["k"]) for r in curve.values() if r["draft"] != NONE}.pop()
    scaled = router.cost_model
    kc = scaled.collected_k
    unscaled = copy.deepcopy(scaled)
    for c in unscaled.costs.values():
        c.pop("verify_shift_scale", None)
    print(f"router {args.router}; K = {kc} rows {args.rows}, K = {k2} rows {args.curve}\n")
    print(f"| drafter | family | prompts | measured K={kc} | measured K={k2} | predicted K={kc} | predicted K={k2} unscaled "
          f"| predicted K={k2} scaled | accepted/call K={k2} measured | geometric |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in sorted({d for _, d in curve} - {NONE}):
        ids = sorted(p for (p, name) in curve if name == d and (p, d) in at_k)
        fam = defaultdict(list)
        for i, p in enumerate(ids):
            fam[at_k[(p, d)]["domain"]].append(i)
        rates = torch.tensor([float(at_k[(p, d)]["acceptance_rate"]) for p in ids])  # [P]
        lengths = torch.tensor([float(at_k[(p, d)]["prompt_tokens"]) for p in ids])  # [P]
        fills = torch.tensor([float(at_k[(p, d)]["mean_k"]) / kc for p in ids])  # [P] slots a call filled at K_c
        geometric = fills * (expected_tokens(per_token_acceptance(rates, kc)[:, None], torch.tensor([float(k2)]))[:, 0] - 1)  # [P]
        for f, ix in [*fam.items(), ("all", list(range(len(ids))))]:
            sub, n = rates[ix], lengths[ix]
            cells = [statistics.fmean(at_k[(ids[i], d)]["speedup"] for i in ix),
                     statistics.fmean(curve[(ids[i], d)]["speedup"] for i in ix),
                     unscaled.mean_speedup_at(d, sub, kc, n), unscaled.mean_speedup_at(d, sub, k2, n),
                     scaled.mean_speedup_at(d, sub, k2, n),
                     statistics.fmean(curve[(ids[i], d)]["mean_accepted_length"] - 1 for i in ix),
                     float(geometric[ix].mean())]  # fmt: skip
            print(f"| {d} | {f} | {len(ix)} | " + " | ".join(f"{x:.2f}" for x in cells) + " |")
    print("\nmedian verify step (ms), each run beside its target alone's one-token step:\n")
    for name, rows, k in (("collected", at_k, kc), ("second K", curve, k2)):
        by = defaultdict(list)
        for (_, d), r in rows.items():
            by[d].append(r["target_step_ms"])
        print(f"- {name} (K = {k}): " + ", ".join(f"{d} {statistics.median(v):.1f}" for d, v in sorted(by.items())))
    table = router.info.get("step_table")
    if table:
        ratio = [float(step_ms(table, 1, torch.tensor(float(k + 1))) / step_ms(table, 1, torch.tensor(1.0))) for k in (kc, k2)]
        print(f"- the step table at batch one: a verify of {kc + 1} tokens {ratio[0]:.2f}, of {k2 + 1} tokens {ratio[1]:.2f} "
              "one-token steps")  # fmt: skip


if __name__ == "__main__":
    main()
