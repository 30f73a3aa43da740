"""Compare drafting-stop rules with Choral alone, on prompts that spec-bench does not use.

    python scripts/experiments/tune_draft_stop.py --prompts-per-domain 4 --out runs/tune-draft-stop

Each setting is an engine with the same target and draft (the recommended CPU setup: fp32 target,
W8A8 int8 draft, K up to 8); every prompt runs through all of them, in alternating order, greedy.
Prompts are rows ``--offset`` on of each domain (20 by default: past spec-bench's first 10 and
below the router's rows 100 on), so a stop tuned here is then checked on spec-bench's own prompts.
Besides tokens/s (noisy on a shared machine) it reports what the step costs predict:
tokens per target call / (drafted per call x draft step + verify step) in tokens per second.
Every output must equal the first setting's (all are lossless greedy decoding).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from serving.engine.core import DRAFT_STOPS, SpeculativeEngine
from serving.engine.cpu_kernels import use_cpu_kernels
from serving.engine.engine_settings import EngineConfig
from serving.engine.request import Request
from serving.engine.models import load_model, load_tokenizer
from serving.prompts import DOMAINS, encode_prompt, load_prompts


def parse_setting(text: str) -> tuple[str, float]:
    stop, _, value = text.partition(":")
    if stop not in DRAFT_STOPS or not value:
        raise argparse.ArgumentTypeError(f"setting {text!r}: expected token:C or cumulative:C, e.g. cumulative:0.4")
    return stop, float(value)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--settings", nargs="+", type=parse_setting,
                    default=[("token", 0.4), ("cumulative", 0.4), ("cumulative", 0.2)], help="STOP:C, e.g. cumulative:0.4")
    ap.add_argument("--prompts-per-domain", type=int, default=4)
    ap.add_argument("--offset", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--draft-weights", choices=["fp32", "int8"], default="int8")
    ap.add_argument("--out", default="runs/tune-draft-stop")
    args = ap.parse_args(argv)

    tokenizer = load_tokenizer(args.target)
    target, draft = load_model(args.target), load_model(args.draft)
    use_cpu_kernels([target], drafts=[draft], draft_weights=args.draft_weights, device="cpu", dtype="float32",
                    widths=EngineConfig(k="auto", k_buckets=tuple(range(1, args.k + 1))).step_widths)
    engines = {s: SpeculativeEngine(target, tokenizer, draft, EngineConfig(k=args.k, draft_confidence=s[1], draft_stop=s[0]))
               for s in args.settings}  # fmt: skip
    prompts = [encode_prompt(tokenizer, p)[-384:] for d in DOMAINS for p in load_prompts(d, args.prompts_per_domain, offset=args.offset)]
    for engine in engines.values():  # untimed warm-up
        engine.generate([Request(prompts[0], max_new_tokens=8)])

    keys = ("new_tokens", "total_time_s", "target_calls", "drafted", "accepted", "draft_time_s", "target_time_s")
    totals = {s: dict.fromkeys(keys, 0.0) for s in args.settings}
    identical = {s: 0 for s in args.settings}
    for i, prompt in enumerate(tqdm(prompts, desc="prompts")):
        reference = None
        for s in args.settings if i % 2 == 0 else args.settings[::-1]:
            [out] = engines[s].generate([Request(prompt, max_new_tokens=args.max_new_tokens)])
            for key in keys:
                totals[s][key] += out.stats[key]
            if reference is None:  # lossless: every setting must give the first one's output
                reference = out.token_ids
            identical[s] += int(out.token_ids == reference)

    rows = []
    for s, t in totals.items():
        calls, drafted = t["target_calls"], t["drafted"]
        draft_step = t["draft_time_s"] / drafted if drafted else 0.0
        verify_step = t["target_time_s"] / calls
        per_call = (t["new_tokens"] - len(prompts)) / calls  # the first token comes from the prefill
        rows.append({
            "stop": s[0], "confidence": s[1], "tokens_per_second": t["new_tokens"] / t["total_time_s"],
            "drafted_per_call": drafted / calls, "acceptance_rate": t["accepted"] / drafted if drafted else 0.0,
            "tokens_per_target_call": per_call, "draft_step_ms": 1e3 * draft_step, "verify_step_ms": 1e3 * verify_step,
            "predicted_tokens_per_second": per_call / (drafted / calls * draft_step + verify_step),
            "identical": identical[s], "prompts": len(prompts),
        })  # fmt: skip
    lines = [f"Choral alone, {len(prompts)} prompts (rows {args.offset}.. of each domain), {args.max_new_tokens} new tokens, "
             f"K up to {args.k}, {args.draft_weights} draft. Command: `python scripts/experiments/tune_draft_stop.py "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             "| stop | confidence | tok/s | drafted / call | acceptance | tokens / call | draft step ms | verify ms | tok/s from step costs | identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['stop']} | {r['confidence']} | {r['tokens_per_second']:.2f} | {r['drafted_per_call']:.2f} | "
                     f"{r['acceptance_rate']:.3f} | {r['tokens_per_target_call']:.2f} | {r['draft_step_ms']:.0f} | "
                     f"{r['verify_step_ms']:.0f} | {r['predicted_tokens_per_second']:.2f} | {r['identical']}/{r['prompts']} |")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(rows, indent=1))
    (out / "tune.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["identical"] == r["prompts"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
