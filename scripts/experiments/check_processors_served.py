"""The official ``openai`` client against ``serve`` on the bundled pair with every sampling field of
issue 71 on: each field accepted and returned as the client expects, greedy output identical across
drafters with the processors on, and each drafter's speed with the processors against without.

    python scripts/experiments/check_processors_served.py --prompts 10 --max-tokens 32 --out docs/experiments/data

Starts ``serve`` on a free loopback port with an untrained router over the bundled 0.5B draft (only
its drafter names matter: every request forces its drafter with the ``draft`` body field), then
sends each held-out workload prompt (test split) to each drafter, with and without the processors
(logit_bias banning a token, frequency, presence and repetition penalties, min_p; logprobs with 3
alternatives), one request at a time, and a streamed copy of a few to compare with the non-streamed
answer. Writes ``processors_served.json`` under ``--out``.
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
DRAFTERS = ("none", "draft", "ngram", "suffix", "auto")


def fields(banned: int) -> dict:
    return dict(logprobs=True, top_logprobs=3, frequency_penalty=0.3, presence_penalty=0.3, logit_bias={str(banned): -100},
                extra_body={"min_p": 0.05, "repetition_penalty": 1.1})  # fmt: skip


def ask(client, model, text, drafter, max_tokens, extra: dict | None):
    extra = dict(extra or {})
    body = extra.pop("extra_body", {}) | {"draft": drafter}
    started = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                                       temperature=0, extra_body=body, **extra)  # fmt: skip
    return r, time.perf_counter() - started


def streamed(client, model, text, drafter, max_tokens, extra):
    extra = dict(extra)
    body = extra.pop("extra_body", {}) | {"draft": drafter}
    content, logprobs = [], []
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                                                temperature=0, stream=True, extra_body=body, **extra):  # fmt: skip
        if chunk.choices and chunk.choices[0].delta.content:
            content.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            logprobs += [(t.token, round(t.logprob, 5)) for t in chunk.choices[0].logprobs.content]
    return "".join(content), logprobs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--streamed", type=int, default=2, help="prompts also sent streamed, per drafter")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra key=value for serve (repeatable)")
    ap.add_argument("--out", default="runs/processors-served")
    args = ap.parse_args(argv)

    from serving.engine.devices import describe_machine
    from serving.engine.models import load_tokenizer
    from serving.server.launch import serving_drafts
    from serving.workload import load_workload

    per_family = max(1, -(-args.prompts // 6))
    texts = [p.text for p in load_workload("test", per_family)][: args.prompts]
    tok = load_tokenizer(args.target)
    banned = tok.encode(" However", add_special_tokens=False)[0]
    extra = fields(banned)
    rows: dict[str, list] = {d: [] for d in DRAFTERS}
    checks = {"top_logprobs_3": True, "one_logprob_per_token": True, "banned_never_sent": True, "streamed_equal": True}
    with serving_drafts(args.target, {"draft": args.draft}, args.serve_arg) as (client, model):
        for i, text in enumerate(texts):
            for drafter in DRAFTERS:  # interleaved per prompt
                plain, plain_s = ask(client, model, text, drafter, args.max_tokens, None)
                r, s = ask(client, model, text, drafter, args.max_tokens, extra)
                content, lp = r.choices[0].message.content, r.choices[0].logprobs.content
                checks["top_logprobs_3"] &= all(len(t.top_logprobs) == 3 for t in lp)
                checks["one_logprob_per_token"] &= len(lp) == r.usage.completion_tokens
                checks["banned_never_sent"] &= tok.decode([banned]) not in "".join(t.token for t in lp)
                row = {"prompt": i, "content": content, "tokens": r.usage.completion_tokens, "seconds": s,
                       "plain_tokens": plain.usage.completion_tokens, "plain_seconds": plain_s,
                       "choral": {k: v for k, v in (r.model_extra or {}).get("choral", {}).items() if k in ("draft", "processors")}}  # fmt: skip
                if i < args.streamed:
                    s_content, s_lp = streamed(client, model, text, drafter, args.max_tokens, extra)
                    checks["streamed_equal"] &= s_content == content and s_lp == [(t.token, round(t.logprob, 5)) for t in lp]
                rows[drafter].append(row)
            print(f"prompt {i}: " + ", ".join(f"{d} {rows[d][-1]['tokens'] / rows[d][-1]['seconds']:.1f} tok/s" for d in DRAFTERS),
                  flush=True)  # fmt: skip
    reference = [r["content"] for r in rows["none"]]
    summary = {}
    for drafter, rs in rows.items():
        tps = sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)
        plain_tps = sum(r["plain_tokens"] for r in rs) / sum(r["plain_seconds"] for r in rs)
        summary[drafter] = {"identical_to_target_alone": sum(r["content"] == c for r, c in zip(rs, reference)), "prompts": len(rs),
                            "tokens_per_s": tps, "plain_tokens_per_s": plain_tps, "processed_over_plain": tps / plain_tps}  # fmt: skip
    result = {"date": datetime.date.today().isoformat(), "machine": describe_machine(with_threads=True),
              "command": "python " + " ".join(sys.argv), "fields": extra, "checks": checks, "summary": summary, "rows": rows}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "processors_served.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"checks": checks, "summary": summary}, indent=1))
    return 0 if all(checks.values()) and all(s["identical_to_target_alone"] == s["prompts"] for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
