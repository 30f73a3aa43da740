"""What ``engine.step_k=goodput`` decides at a full batch, without HTTP: one engine on the q4 pair
decodes the routing workload's test prompts at batch 8 under several (drafter, K, step_k) runs,
and prints each run's tokens/s, the caps the planner chose by occupied rows, and the verify times
the engine measured (timed at load by ``SpeculativeEngine.time_steps``, then by its own steps);
``--phases`` also times the target's forwards by shape and the verify's probabilities and
accept/reject over each run's serving steps.

    python scripts/experiments/probe_goodput.py none:4:rows ngram:1:rows ngram:4:goodput suffix:4:goodput none:4:rows

Each argument is DRAFTER:K:STEP_K. The runs share one loaded engine, one after the other, so the
first and a last ``none`` run bracket the machine's drift. Writes ``probe.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import serving.engine.k_policy as k_policy  # noqa: E402
from serving.engine import Request  # noqa: E402
from serving.engine.engine_settings import EngineSettings
from serving.engine.loader import load_engine
from serving.engine.goodput import StepCosts  # noqa: E402
from serving.workload import FAMILIES, load_family  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="DRAFTER:K:STEP_K, e.g. ngram:4:goodput")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="the target (default: the bundled 1.5B)")
    ap.add_argument("--per-family", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--weights", default="q4", help="target_weights and draft_weights")
    ap.add_argument("--drafts", default="ngram=ngram,suffix=suffix",
                    help="NAME=REF,... the engine's drafters beside none (a model reference, ngram, suffix, auto)")
    ap.add_argument("--profile", default="none",
                    help="profile_step.py output: the table for shapes not timed (none: no table)")
    ap.add_argument("--phases", action="store_true",
                    help="also time the target's forwards by shape and the verify's probabilities and accept/reject")
    ap.add_argument("--out", default="runs/probe-goodput")
    args = ap.parse_args(argv)
    runs = []
    for spec in args.runs:
        drafter, k, step_k = spec.split(":")
        runs.append((drafter, int(k), step_k))
    prompts = [p for group in zip(*[load_family(f, "test", args.per_family) for f in FAMILIES]) for p in group]
    settings = EngineSettings(target_weights=args.weights, draft_weights=args.weights, max_batch_size=args.batch, k=4,
                              step_k="goodput")  # fmt: skip
    drafts = dict(pair.split("=", 1) for pair in args.drafts.split(","))
    loaded = load_engine(settings, args.target, {**drafts, "none": None})
    engine, tok = loaded.engine, loaded.tokenizer
    table = None
    if args.profile != "none":
        rows = json.loads(Path(args.profile).read_text())["rows"]
        table = [[r["batch_rows"], r["tokens"], r["step_ms"]] for r in rows]

    def ids(p):
        if p.use_chat_template:
            return tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)  # fmt: skip
        return tok.encode(p.text, add_special_tokens=False)

    prompt_ids = [ids(p) for p in prompts]
    caps: collections.Counter = collections.Counter()
    plan = k_policy.plan_cap

    def counted(expected, fixed, cost, ks):
        cap = plan(expected, fixed, cost, ks)
        caps[(len(expected), cap)] += 1
        return cap

    k_policy.plan_cap = counted
    phases: collections.defaultdict = collections.defaultdict(list)  # name -> ms of each call, this run
    if args.phases:
        import serving.engine.speculative as speculative
        from serving.engine.runner import ModelRunner

        def timed(name, f):
            def wrapper(*a, **kw):
                started = time.perf_counter()
                out = f(*a, **kw)
                key = f"forward {tuple(a[1].shape)}" if name == "forward" else name  # [rows, width]
                phases[key].append(1e3 * (time.perf_counter() - started))
                return out
            return wrapper

        speculative.probs_from_logits = timed("probabilities", speculative.probs_from_logits)
        speculative.accept_reject = timed("accept/reject", speculative.accept_reject)
        ModelRunner.forward = timed("forward", ModelRunner.forward)  # the draft models' too, by their shapes
    results = []
    for drafter, k, step_k in runs:
        engine.config.k, engine.config.step_k = k, step_k
        engine.step_costs = StepCosts(table)
        engine.time_steps()
        caps.clear()
        phases.clear()  # the serving steps only, not the timing at load
        started = time.perf_counter()
        outs = engine.generate([Request(p, max_new_tokens=args.max_tokens, drafter=drafter) for p in prompt_ids])
        wall = time.perf_counter() - started
        tokens = sum(len(o.token_ids) for o in outs)
        verify = {f"{r}x{w}": round(ms, 1) for (r, w), ms in sorted(engine.step_costs.verify.items()) if r == args.batch and w <= 3}
        # Each row's stats hold the phases of every step it was in: per step, the draft phase (host
        # proposals included) and the verify (the stats' own target_step_ms), averaged over the rows.
        stepped = [o.stats for o in outs if o.stats["target_calls"]]
        row = {"run": f"{drafter}:{k}:{step_k}", "tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
               "drafted": sum(o.stats["drafted"] for o in outs), "accepted": sum(o.stats["accepted"] for o in outs),
               "draft_phase_ms": statistics.fmean(1e3 * st["draft_time_s"] / st["target_calls"] for st in stepped) if stepped else 0.0,
               "verify_phase_ms": statistics.fmean(st["target_step_ms"] for st in stepped) if stepped else 0.0,
               "caps": {f"{n} rows -> {c}": v for (n, c), v in sorted(caps.items(), key=str)}, "verify_ms": verify,
               "phases_median_ms": {k: round(statistics.median_high(v), 1) for k, v in sorted(phases.items())},
               "phases_calls": {k: len(v) for k, v in sorted(phases.items())}}  # fmt: skip
        results.append(row)
        print(f"{row['run']}: {row['tok_s']:.2f} tok/s ({tokens} tokens, {wall:.1f} s), drafted {row['drafted']}, "
              f"accepted {row['accepted']}; per step: draft phase {row['draft_phase_ms']:.1f} ms, verify phase "
              f"{row['verify_phase_ms']:.1f} ms; verify ms at {args.batch} rows {verify}; caps {row['caps']}", flush=True)  # fmt: skip
        if args.phases:
            print("  medians, ms (calls): " + ", ".join(f"{k} {v} ({row['phases_calls'][k]})" for k, v in row["phases_median_ms"].items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join(["python scripts/experiments/probe_goodput.py", *(argv if argv is not None else sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": platform.processor() or platform.machine(),
              "runs": results}  # fmt: skip
    (out / "probe.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
