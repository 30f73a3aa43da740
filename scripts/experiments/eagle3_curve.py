"""The EAGLE-3 head's learning curve from a ``train-draft`` run (issue 60).

    python scripts/experiments/eagle3_curve.py runs/eagle3-code-quick --out runs/eagle3-code-quick/curve.png

Reads the run's ``metrics.json`` (``last/progress.json`` while it is still running): each held-out
evaluation (tokens per target call and acceptance on the evaluation prompts, greedy, with the
engine; top-1 agreement with the target per unrolled step on held-out rows) against the training
tokens seen by then (the quick profile's schedule is constant, so an evaluation at step s is what
a run of s steps gives). Prints a table and draws the curve with the issue's bar (2.0 tokens per
call) and this machine's break-even against the 0.5B (``--break-even``, from
docs/experiments/eagle3-break-even.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def points(progress: dict) -> list[dict]:
    rows_per_step = progress["tokens"] / max(progress["step"], 1)  # tokens per optimizer step
    out = []
    for h in [progress["before"] | {"step": 0}, *progress["history"]]:
        if "tokens_per_target_call" not in h:
            continue
        out.append({"step": h["step"], "tokens": int(h["step"] * rows_per_step), "tau": h["tokens_per_target_call"],
                    "acceptance": h["acceptance_rate"], "agreement": [h.get(f"val_agreement_{j}") for j in range(8)
                                                                      if f"val_agreement_{j}" in h]})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="the train-draft output.dir")
    ap.add_argument("--break-even", type=float, default=3.15, help="tokens per call the head needs for 1.15x the 0.5B here")
    ap.add_argument("--out", default=None, help="the plot (default: <run>/curve.png)")
    args = ap.parse_args(argv)
    run = Path(args.run)
    path = run / "metrics.json" if (run / "metrics.json").exists() else run / "last" / "progress.json"
    pts = points(json.loads(path.read_text()))
    print("| step | training tokens | tokens per target call | acceptance | top-1 agreement per unrolled step |")
    print("|---|---|---|---|---|")
    for p in pts:
        print(f"| {p['step']} | {p['tokens']} | {p['tau']:.3f} | {p['acceptance']:.3f} | {', '.join(f'{a:.3f}' for a in p['agreement'])} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([p["tokens"] for p in pts], [p["tau"] for p in pts], marker="o", label="quick-profile code head")
    ax.axhline(2.0, ls="--", c="gray", label="issue's bar: 2.0 tokens per call")
    ax.axhline(args.break_even, ls=":", c="red", label=f"1.15x the 0.5B here: {args.break_even}")
    ax.set_xlabel("training tokens"), ax.set_ylabel("tokens per target call (held-out code)")
    ax.set_ylim(0.9, max(3.5, args.break_even + 0.2))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out or run / "curve.png", dpi=110)
    print(f"-> {args.out or run / 'curve.png'}")


if __name__ == "__main__":
    main()
