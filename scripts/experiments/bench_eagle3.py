"""EAGLE-3 heads against the 0.5B draft, ``ngram`` and ``suffix`` on held-out prompts (issue 60).

    python scripts/experiments/bench_eagle3.py --head code=runs/eagle3-code-quick/best --per-domain 4 --max-tokens 48 --out runs/bench-eagle3

1. One engine at the default precisions (a bundled target: q4 on Choral's CPU kernels; drafts
   beside it at q4) holding ``ngram``, ``suffix``, the 0.5B draft and each ``--head`` folder.
2. The first ``--per-domain`` evaluation prompts of code (HumanEval), chat (ShareGPT) and math
   (mathematics-dataset), never seen in training, each decoded greedily by the target alone and
   by every drafter, in an order rotated per prompt (one interleaved run), timed end to end
   (prefill included). Every output is checked against the target alone's.
3. Step costs: a head's drafting step (one width-1 forward of the head, its cache at the prompt's
   length) and the 0.5B's, against the q4 target's one-token step, at batch 1 and batch 8,
   median of ``--steps`` after warm-up.

Writes ``eagle3.json`` and ``eagle3.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
DOMAINS = ("code", "chat", "math")


def step_ms(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def step_costs(loaded, heads: dict, steps: int, at: int = 200) -> dict:
    """ms of one drafting step of each head and of the 0.5B, and of the target's one-token step,
    at batch 1 and 8 (caches filled to position ``at``; the values do not matter for the cost)."""
    import torch

    engine = loaded.engine
    target = engine.verifier.runner
    out = {}
    for rows in (1, 8):
        pos = torch.full((rows, 1), at, dtype=torch.long)
        tok = torch.zeros(rows, 1, dtype=torch.long)
        out[f"target_b{rows}"] = step_ms(lambda: target.forward(tok, pos), steps)
        draft = engine.drafters["draft"].runner
        out[f"draft_b{rows}"] = step_ms(lambda: draft.forward(tok, pos, last_only=True), steps)
        k = engine.config.k_max
        for name in heads:
            d = engine.drafters[name]
            c = d.head.config
            state = torch.zeros(rows, 1, c.hidden_size)
            chain = step_ms(lambda d=d, state=state: d.head.step(tok, state, pos, d.cache), steps)
            # The step's first forward reads the committed pairs (K + 1 wide, the target's features).
            wide = torch.arange(at, at + k + 1).repeat(rows, 1)
            feats = torch.zeros(rows, k + 1, len(c.aux_layers) * c.target_hidden_size)
            first = step_ms(lambda d=d, feats=feats, wide=wide: d.head.step(torch.zeros_like(wide), feats, wide, d.cache), steps)
            out[f"{name}_b{rows}"] = (first + (k - 1) * chain) / k  # per drafted token, K per step
            out[f"{name}_chain_b{rows}"], out[f"{name}_first_b{rows}"] = chain, first
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", action="append", default=[], metavar="NAME=DIR", help="an EAGLE-3 head folder (repeatable)")
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("--per-domain", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per step-cost measurement")
    ap.add_argument("--out", default="runs/bench-eagle3")
    args = ap.parse_args(argv)

    from serving.engine.devices import describe_machine
    from serving.engine.engine_settings import EngineSettings
    from serving.engine.loader import load_engine
    from serving.engine.request import Request
    from serving.prompts import encode_prompt, load_prompts

    heads = dict(h.split("=", 1) for h in args.head)
    refs = {"none": None, "ngram": "ngram", "suffix": "suffix", "draft": args.draft} | heads
    settings = EngineSettings(device="cpu", k=args.k, max_batch_size=8, max_len=1024)
    loaded = load_engine(settings, args.target, refs)
    tok, engine = loaded.tokenizer, loaded.engine
    names = list(refs)
    runs = []
    for d_i, domain in enumerate(DOMAINS):
        for p_i, prompt in enumerate(load_prompts(domain, args.per_domain)):
            ids = encode_prompt(tok, prompt)[-384:]
            shift = (d_i * args.per_domain + p_i) % len(names)
            outs = {}
            for name in names[shift:] + names[:shift]:  # rotated: no drafter always runs first
                started = time.perf_counter()
                [o] = engine.generate([Request(ids, max_new_tokens=args.max_tokens, drafter=name)])
                outs[name] = (o, time.perf_counter() - started)
            ref = outs["none"][0].token_ids
            for name, (o, seconds) in outs.items():
                s = o.stats
                runs.append({"domain": domain, "prompt": p_i, "drafter": name, "seconds": seconds, "new_tokens": s["new_tokens"],
                             "target_calls": s["target_calls"], "drafted": s["drafted"], "accepted": s["accepted"],
                             "identical": o.token_ids == ref})  # fmt: skip
            print(domain, p_i, {n: round(outs["none"][1] / outs[n][1], 2) for n in names}, flush=True)
    costs = step_costs(loaded, heads, args.steps)
    rows = []
    for domain in (*DOMAINS, "all"):
        mine = [r for r in runs if domain == "all" or r["domain"] == domain]
        alone = sum(r["seconds"] for r in mine if r["drafter"] == "none")
        for name in names:
            rs = [r for r in mine if r["drafter"] == name]
            calls = sum(r["target_calls"] for r in rs)
            drafted = sum(r["drafted"] for r in rs)
            rows.append({
                "domain": domain, "drafter": name, "speedup": alone / sum(r["seconds"] for r in rs),
                "tokens_per_call": sum(r["new_tokens"] - 1 for r in rs) / calls if calls else 0.0,
                "acceptance": sum(r["accepted"] for r in rs) / drafted if drafted else 0.0,
                "identical": f"{sum(r['identical'] for r in rs)}/{len(rs)}",
            })  # fmt: skip
    result = {"date": datetime.date.today().isoformat(), "machine": describe_machine(with_threads=True), "args": vars(args), "step_ms": costs,
              "rows": rows, "runs": runs}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eagle3.json").write_text(json.dumps(result, indent=1))
    lines = [f"{result['date']}, {result['machine']}; {args.per_domain} prompts per domain, {args.max_tokens} tokens, K {args.k}", "",
             "| domain | drafter | tokens per target call | acceptance | speedup over target alone | identical |", "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['domain']} | {r['drafter']} | {r['tokens_per_call']:.2f} | {r['acceptance']:.2f} | {r['speedup']:.2f}x | {r['identical']} |"
              for r in rows]  # fmt: skip
    lines += ["", "| step | batch 1 ms | / target step | batch 8 ms | / target step |", "|---|---|---|---|---|"]
    for name in ["target", "draft", *heads]:
        b1, b8 = costs[f"{name}_b1"], costs[f"{name}_b8"]
        lines.append(f"| {name} | {b1:.1f} | {b1 / costs['target_b1']:.3f} | {b8:.1f} | {b8 / costs['target_b8']:.3f} |")
    (out / "eagle3.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
