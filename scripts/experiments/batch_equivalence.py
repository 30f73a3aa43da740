"""Batch of B ragged prompts vs each prompt alone: are the greedy speculative outputs identical?

    python scripts/experiments/batch_equivalence.py --batch 4 --max-new-tokens 64 --out runs/batch_equivalence.json

Rows of a batch accept different numbers of tokens and finish on their own; the static-shape
engine must give each row exactly what it gives that prompt alone. A difference is reported with
the target's top-2 logit gap at the first differing token (a near-tie, or a bug).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from serving.engine.engine_settings import EngineSettings
from serving.engine.loader import build_engine, prepare_kernels
from serving.engine.models import load_model, load_tokenizer
from serving.engine.request import Request
from serving.prompts import encode_prompt, load_prompts
from serving.tools.bench import compare


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-cpu-kernels", action="store_true", help="stock PyTorch kernels instead of Choral's")
    ap.add_argument("--out", default="runs/batch_equivalence.json")
    args = ap.parse_args(argv)

    tokenizer = load_tokenizer(args.target)
    target, draft = load_model(args.target, dtype=args.dtype), load_model(args.draft, dtype=args.dtype)
    settings = EngineSettings(device="cpu", dtype=args.dtype, cpu_kernels=not args.no_cpu_kernels, max_len=1024, k=args.k)
    # both models keep their fp32 numerics on the kernels (the draft too: this compares rows, not precisions)
    prepare_kernels(settings, [target, draft], [], settings.engine_config(draft=True).step_widths)
    # Ragged on purpose: prompts from different domains have very different lengths.
    per_domain = [load_prompts(d, args.batch) for d in ("code", "chat", "math")]
    prompts = [p for group in zip(*per_domain) for p in group][: args.batch]
    requests = [Request(encode_prompt(tokenizer, p), max_new_tokens=args.max_new_tokens) for p in prompts]
    batched = build_engine(settings, tokenizer, target, {"draft": draft}, max_batch_size=args.batch)
    single = build_engine(settings, tokenizer, target, {"draft": draft}, max_batch_size=1)
    outs_b = batched.generate(requests)
    outs_1 = single.generate(requests)
    rows = []
    for p, r, b, s in zip(prompts, requests, outs_b, outs_1):
        check = compare(target, r.prompt_ids, s.token_ids, b.token_ids)
        rows.append({"id": p.id, "prompt_tokens": len(r.prompt_ids), "new_tokens": len(s.token_ids), **check})
        print(f"{p.id:28s} prompt {len(r.prompt_ids):4d} tokens  identical={check['identical']}"
              + ("" if check["identical"] else f"  first diff {check['first_diff']} gap {check['top2_gap']:.2e}"))
    report = {"config": vars(args), "rows": rows, "identical": sum(r["identical"] for r in rows), "batch": len(rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{report['identical']}/{report['batch']} rows identical to their batch-of-1 runs; wrote {args.out}")


if __name__ == "__main__":
    main()
