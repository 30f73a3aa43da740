"""Logits processors under speculation on the bundled pair (issue 71): what they cost, and that
greedy output stays identical across drafters with them on.

    python scripts/experiments/bench_processors.py --prompts 12 --max-tokens 48 --out docs/experiments/data

1. Cost: the processors' own work on a batch-8 verify (``processors.process`` over [8, K+1, V]
   with every processor on, plus min_p in ``probs_from_logits`` on sampled rows) against the
   target's verify forward at the same shape, each the fastest of ``--reps``; logprobs apart.
2. End to end: held-out workload prompts (test split) decoded greedily at batch 8, the target
   alone and each drafter, with and without the processors (bias, repetition, frequency and
   presence penalties, min_p), interleaved. Every output with the processors is checked against
   the target alone's with them; the speedup of each drafter is reported with and without them.

Writes ``processors.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
DRAFTERS = ("none", "ngram", "suffix", "draft", "auto")


def settings(tok):
    from serving.engine.sampling import SamplingParams

    banned = tok.encode(" however", add_special_tokens=False)[0]
    return SamplingParams(logit_bias=((banned, -100.0),), repetition_penalty=1.1, frequency_penalty=0.3,
                          presence_penalty=0.3, min_p=0.05)  # fmt: skip


def fastest_ms(run, reps: int) -> float:
    run()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        run()
        times.append(1e3 * (time.perf_counter() - started))
    return min(times)


def cost(engine, params, args) -> dict:
    """The processors' work on a batch-8 verify of K+1 positions against the verify forward: the
    bias and penalties (``process``), min_p on sampled rows (temperature 1, against the same rows
    without it), and, apart, the logprobs of a step (``step_logprobs``, 2 alternatives)."""
    import dataclasses

    import torch

    from serving.engine.processors import Processors, process
    from serving.engine.sampling import SamplingTensors, probs_from_logits
    from serving.engine.speculative import step_logprobs

    B, K, V = args.batch, args.k, engine.vocab_size
    g = torch.Generator().manual_seed(0)
    procs = Processors(B, V, torch.device("cpu"))
    for b in range(B):
        procs.start(b, params, torch.randint(0, V, (200,), generator=g).tolist(), 5)
    procs.commit(torch.randint(0, V, (B, 60), generator=g), torch.full((B,), 60))
    rows = procs.rows(B, [params] * B)
    logits = torch.randn(B, K + 1, V, generator=g)
    drafts = torch.randint(0, V, (B, K), generator=g)
    n = torch.full((B,), K)
    sampled = dataclasses.replace(params, temperature=1.0)
    plain = SamplingTensors.build([dataclasses.replace(sampled, min_p=0.0)] * B, "cpu")
    with_min_p = SamplingTensors.build([sampled] * B, "cpu", rows)
    processing = fastest_ms(lambda: process(logits, rows, drafts, n), args.reps)
    sampling_plain = fastest_ms(lambda: probs_from_logits(logits, plain), args.reps)
    sampling_min_p = fastest_ms(lambda: probs_from_logits(logits, with_min_p), args.reps)
    nxt = torch.zeros(B, dtype=torch.long)
    logprobs = fastest_ms(lambda: step_logprobs(logits, drafts, n, nxt, 2), args.reps)
    verify = fastest_ms(lambda: engine.verifier.warmup((K + 1,), B), args.reps)
    extra = processing + max(0.0, sampling_min_p - sampling_plain)
    return {"batch": B, "width": K + 1, "vocab": V, "process_ms": processing, "min_p_ms": sampling_min_p - sampling_plain,
            "logprobs_ms": logprobs, "verify_forward_ms": verify, "share_of_verify": extra / verify,
            "logprobs_share_of_verify": logprobs / verify}  # fmt: skip


def run(engine, prompts, params, drafter, max_tokens):
    from serving.engine import Request

    started = time.perf_counter()
    outs = engine.generate([Request(p, params, max_new_tokens=max_tokens, drafter=drafter) for p in prompts])
    seconds = time.perf_counter() - started
    return outs, seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("--prompts", type=int, default=12, help="held-out workload prompts (test split, spread over the families)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--out", default="runs/processors")
    args = ap.parse_args(argv)

    from serving.engine.devices import describe_machine
    from serving.engine.engine_settings import EngineSettings
    from serving.engine.loader import load_engine
    from serving.engine.sampling import SamplingParams
    from serving.prompts import encode_prompt
    from serving.workload import load_workload

    refs = {"none": None, "ngram": "ngram", "suffix": "suffix", "draft": args.draft, "auto": "auto"}
    loaded = load_engine(EngineSettings(device="cpu", max_len=args.max_len, k=args.k, max_batch_size=args.batch), args.target, refs)
    engine, tok = loaded.engine, loaded.tokenizer
    params = settings(tok)
    per_family = max(1, -(-args.prompts // 6))
    prompts = [encode_prompt(tok, p) for p in load_workload("test", per_family)][: args.prompts]
    result = {"date": datetime.date.today().isoformat(), "machine": describe_machine(with_threads=True),
              "command": "python " + " ".join(sys.argv), "processors": list(params.processors),
              "cost": cost(engine, params, args), "runs": {}}  # fmt: skip
    print(f"cost at batch {args.batch}: {result['cost']}", flush=True)
    reference = None
    for drafter in DRAFTERS:  # interleaved: each drafter without, then with the processors
        row = {}
        for label, p in (("plain", SamplingParams()), ("processed", params)):
            outs, seconds = run(engine, prompts, p, drafter, args.max_tokens)
            tokens = sum(len(o.token_ids) for o in outs)
            row[label] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                          "tokens_per_call": tokens / max(1, sum(o.stats["target_calls"] for o in outs))}  # fmt: skip
            if label == "processed":
                ids = [o.token_ids for o in outs]
                reference = ids if drafter == "none" else reference
                row["identical_to_target_alone"] = sum(a == b for a, b in zip(ids, reference))
            print(f"{drafter:7s} {label:9s} {row[label]['tokens_per_s']:.2f} tok/s, {row[label]['tokens_per_call']:.2f} tokens/call",
                  flush=True)  # fmt: skip
        result["runs"][drafter] = row
    base = result["runs"]["none"]
    for drafter, row in result["runs"].items():
        for label in ("plain", "processed"):
            row[label]["speedup"] = row[label]["tokens_per_s"] / base[label]["tokens_per_s"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "processors.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({d: {l: round(r[l]["speedup"], 3) for l in ("plain", "processed")} | {"identical": r["identical_to_target_alone"]}
                      for d, r in result["runs"].items()}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
