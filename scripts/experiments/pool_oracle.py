"""What a drafter pool can earn on collected rows: each drafter's measured speedup per family, the
per-prompt oracle, and a family rule (the drafter that was fastest on each family's training
prompts, applied to the held-out ones: what a router that only recognises the family would do).

    python scripts/experiments/pool_oracle.py --train runs/workload-int8/rows-trainval.jsonl \\
        --test runs/workload-int8/rows-test.jsonl

Several files per side combine the same prompts' rows: the pool at several K (eleventh session,
docs/experiments/router-workload.md).

Reads the rows ``collect-router-data`` wrote (greedy rows, one per prompt and drafter, with the
target alone as ``none``); speedups are the rows' own (tokens/s over the target alone on the same
prompt, prefill included). Prints a markdown table and the pool's headline ratios: the oracle and the
family rule over the best single drafter, and the family rule as a share of the oracle. Also counts
the drafting rows whose output differs from their prompt's ``none`` row (greedy: must be none).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routing.dataset import read_collected  # noqa: E402
from routing.router import NONE  # noqa: E402


def by_prompt(paths: list[str], mode: str = "greedy") -> dict[tuple[str, str], dict[str, dict]]:
    """(family, prompt id) -> drafter -> row, over every file (a missing one is an error; drafters
    named apart, as in ``'drafts={ngram8: ngram}'`` collected at ``engine.k=8``; each file's own
    ``none`` row is its baseline, already divided into its rows' speedups)."""
    out: dict[tuple[str, str], dict[str, dict]] = collections.defaultdict(dict)
    for row in read_collected(paths, mode):
        out[(row["domain"], row["prompt_id"])][row["draft"]] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", required=True, nargs="+", help="rows of the training prompts (the family rule learns "
                    "here); several files: the same prompts with other drafters, or at another K")
    ap.add_argument("--test", required=True, nargs="+", help="rows of the held-out prompts (scored here)")
    args = ap.parse_args(argv)
    train, test = by_prompt(args.train), by_prompt(args.test)
    drafts = sorted({d for rows in test.values() for d in rows} - {NONE})
    complete = {key: rows for key, rows in test.items() if all(d in rows for d in (*drafts, NONE))}
    if not complete:
        raise SystemExit(f"{' '.join(args.test)}: no prompt has a row for every drafter ({', '.join(drafts)}) and for none")

    fam_train: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for (family, _), rows in train.items():
        for d, row in rows.items():
            fam_train[family][d].append(float(row["speedup"]))
    rule = {f: max(v, key=lambda d: statistics.fmean(v[d])) for f, v in fam_train.items()}

    cols = [*drafts, "oracle", "family rule"]
    per_family: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    differ = 0
    for (family, _), rows in sorted(complete.items()):
        speed = {d: float(rows[d]["speedup"]) for d in (*drafts, NONE)}
        differ += sum(rows[d]["output_sha"] != rows[NONE]["output_sha"] for d in drafts)
        for d in drafts:
            per_family[family][d].append(speed[d])
        per_family[family]["oracle"].append(max(speed.values()))
        per_family[family]["family rule"].append(speed.get(rule.get(family, NONE), 1.0))
    lines = ["| family | prompts | " + " | ".join(cols) + " | family rule chose |", "|---" * (len(cols) + 3) + "|"]
    overall: dict[str, list[float]] = collections.defaultdict(list)
    for family, v in sorted(per_family.items()):
        for c in cols:
            overall[c] += v[c]
        lines.append(f"| {family} | {len(v['oracle'])} | " + " | ".join(f"{statistics.fmean(v[c]):.2f}" for c in cols)
                     + f" | {rule.get(family, NONE)} |")  # fmt: skip
    mean = {c: statistics.fmean(overall[c]) for c in cols}
    best = max(drafts, key=lambda d: mean[d])
    lines.append(f"| all | {len(overall['oracle'])} | " + " | ".join(f"{mean[c]:.2f}" for c in cols) + " | |")
    print("\n".join(lines))
    print(f"\nbest single drafter: {best} ({mean[best]:.3f}); oracle / best single {mean['oracle'] / mean[best]:.3f}; "
          f"family rule / best single {mean['family rule'] / mean[best]:.3f}, "
          f"{100 * mean['family rule'] / mean['oracle']:.1f}% of the oracle; "
          f"outputs differing from the target alone: {differ} of {len(drafts) * len(complete)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
