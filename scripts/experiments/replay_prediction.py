"""Replay the ``prediction`` drafter over the target's own greedy answers to code edits: how many
target steps, of which widths, each setting of ``engine.prediction.confident_n`` would take.

Greedy output does not depend on the drafter, so one decode per prompt gives the answer, and the
drafter's proposals can then be replayed against it exactly (the proposal, the accepted prefix,
the step's K bucket) for any setting, without running the target again. The steps are costed
with the step times of a ``profile_step.py`` run (its JSON), so the totals are step-seconds on
the machine that profile ran on, not wall clock; ``bench_prediction.py`` measures the real thing.

    python scripts/experiments/profile_step.py --weights q4 --prefill 256 --tokens 1,2,3,4,5,6,7,8,9,13,16 --out runs/profile-widths
    python scripts/experiments/replay_prediction.py --n 10 --step-costs runs/profile-widths/profile.json --out runs/replay-prediction

Prints a markdown table (step-seconds per prompt and setting) and the acceptance of the first
proposed token by alignment length; writes ``replay.json`` with the answers, so ``--answers``
can replay them again without the target.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from serving.engine.drafters.base import RowContext
from serving.engine.drafters.prediction import PredictionDrafter

TARGET = "qwen2.5-coder-1.5b-instruct"


def decode_answers(n: int, max_tokens: int, target_weights: str, target: str = TARGET) -> list[dict]:
    """The target alone's greedy answers to the first n ``edit`` prompts, as the server would
    encode them (chat template; the prediction is the code being edited)."""
    from serving.engine.request import Request
    from serving.engine.engine_settings import EngineSettings
    from serving.engine.loader import load_engine
    from serving.engine.sampling import SamplingParams
    from serving.prompts import load_grounded

    loaded = load_engine(EngineSettings(target_weights=target_weights, max_len=2048), target, {"none": None})
    tok, rows = loaded.tokenizer, []
    for g in load_grounded("edit", n):
        text = tok.apply_chat_template([{"role": "user", "content": g.prompt.text}], tokenize=False, add_generation_prompt=True)
        prompt = tok.encode(text, add_special_tokens=False)
        [out] = loaded.engine.generate([Request(prompt, SamplingParams(), max_tokens)])
        rows.append({"id": g.prompt.id, "prompt": prompt, "prediction": tok.encode(g.source, add_special_tokens=False),
                     "answer": list(out.token_ids)})  # fmt: skip
        print(f"{g.prompt.id}: {len(out.token_ids)} tokens", file=sys.stderr, flush=True)
    return rows


def replay(row: dict, k: int, k_buckets: list[int], confident_n: int, step_ms) -> tuple[float, list[tuple[int, int, int]]]:
    """(step-milliseconds, [(aligned tail length or 0, proposed, accepted)] per step) of one answer."""
    drafter = PredictionDrafter(k=k, confident_n=confident_n)
    drafter.start(0, RowContext(0, row["prompt"], row["prediction"], False))
    answer, pos, total, steps = row["answer"], 1, 0.0, []  # the first token comes from the prefill
    while pos < len(answer):
        context = row["prompt"] + answer[:pos]
        aligned = drafter._align(np.asarray(row["prediction"]), answer[:pos], drafter._cursor[0])
        proposal = drafter.propose(0, context, k)
        accepted = 0
        while accepted < len(proposal) and pos + accepted < len(answer) and proposal[accepted] == answer[pos + accepted]:
            accepted += 1
        width = next(b for b in k_buckets if b >= len(proposal)) + 1 if proposal else 1  # the verify's rows
        total += step_ms(width)
        steps.append((aligned[1] if aligned else 0, len(proposal), accepted))
        pos += accepted + 1
    return total, steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=TARGET, help="the target (default: the bundled 1.5B)")
    ap.add_argument("--n", type=int, default=10, help="edit prompts (the first n of the family)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--target-weights", default="q4", choices=["fp32", "int8", "q4"])
    ap.add_argument("--answers", default=None, help="a replay.json of an earlier run: its answers, no target")
    ap.add_argument("--step-costs", required=True, help="profile_step.py's profile.json (step ms per width)")
    ap.add_argument("--k", type=int, default=15, help="engine.prediction.k")
    ap.add_argument("--k-buckets", default="1,2,3,4,5,6,7,8,12,15")
    ap.add_argument("--confident-n", default="1,2,3,4,5,6,8", help="the settings to replay (1: always k)")
    ap.add_argument("--out", default="runs/replay-prediction")
    args = ap.parse_args(argv)
    profile = json.loads(Path(args.step_costs).read_text())
    measured = {r["tokens"]: r["step_ms"] for r in profile["rows"] if isinstance(r["tokens"], int) and r.get("path", "lean") == "lean"}
    widths = sorted(measured)
    if not widths:
        raise SystemExit(f"replay_prediction: {args.step_costs} has no step rows of the lean forward; give the "
                         "profile.json of a profile_step.py run with --tokens 1,...")  # fmt: skip

    def step_ms(width: int) -> float:  # linear between the profiled widths
        return float(np.interp(width, widths, [measured[w] for w in widths]))

    k_buckets = [int(b) for b in args.k_buckets.split(",")]
    if args.k > max(k_buckets):
        raise SystemExit(f"replay_prediction: --k {args.k} exceeds the largest of --k-buckets {args.k_buckets}: add it")
    if max(k_buckets) + 1 > widths[-1]:
        raise SystemExit(f"replay_prediction: the profile's widths end at {widths[-1]}; a K bucket of {max(k_buckets)} "
                         f"verifies {max(k_buckets) + 1} rows: profile --tokens up to {max(k_buckets) + 1}")  # fmt: skip
    rows = (json.loads(Path(args.answers).read_text())["rows"] if args.answers
            else decode_answers(args.n, args.max_tokens, args.target_weights, args.target))
    settings = sorted({1, *(int(c) for c in args.confident_n.split(","))})  # 1 (always k) is the baseline
    table = {c: [replay(r, args.k, k_buckets, c, step_ms) for r in rows] for c in settings}
    first = defaultdict(lambda: [0, 0])  # aligned tail length -> [proposals, first token accepted] (always k)
    for _, steps in table[1]:
        for n, proposed, accepted in steps:
            if proposed and n:
                first[n][0] += 1
                first[n][1] += accepted > 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "scripts/experiments/replay_prediction.py", *(argv if argv is not None else sys.argv[1:])])
    machine = profile["machine"]
    machine = ", ".join(f"{k} {v}" for k, v in machine.items()) if isinstance(machine, dict) else machine
    lines = [f"`{command}`; step costs: `{profile['command']}` ({profile['date']}, {machine}).", "",
             "| confident_n | " + " | ".join(r["id"].split("/")[-1] for r in rows) + " | total step-s | vs always k |",
             "|---|" + "---|" * (len(rows) + 2)]  # fmt: skip
    base = sum(t for t, _ in table[1])
    for c in settings:
        total = sum(t for t, _ in table[c])
        lines.append(f"| {c} | " + " | ".join(f"{t / 1e3:.2f}" for t, _ in table[c]) + f" | {total / 1e3:.2f} | {base / total:.2f}x |")
    if first:  # always true with answers longer than their first token
        lines += ["", "| aligned tail (tokens) | proposals (always k) | first token accepted |", "|---|---|---|"]
        lines += [f"| {n} | {a} | {b / a:.0%} |" for n, (a, b) in sorted(first.items())]
    (out / "replay.json").write_text(json.dumps({"command": command, "step_costs": args.step_costs, "rows": rows,
                                                 "steps": {c: [s for _, s in table[c]] for c in settings}}))  # fmt: skip
    (out / "replay.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
