"""Teacher-forced greedy agreement of code drafts with the target: a fast proxy for acceptance.

    python scripts/experiments/agreement_probe.py qwen2.5-coder-0.5b-instruct runs/draft-code-head/final \
        --draft-vocab-from runs/draft-code-head/final --out runs/agreement-probe

The target's greedy continuations (48 tokens) of the HumanEval prompts ``--first`` .. ``--first +
--prompts - 1`` (default 32..95: past the first 32, which train-draft's evaluation and
scripts/experiments/compare_drafts.py measure with the engine) are generated once and cached in ``--out``.
Each draft is then scored with one forward pass per prompt: the share of continuation tokens
where its argmax (over its draft vocabulary, when it has one) is the target's token, and the share
of those tokens its vocabulary holds at all. Greedy acceptance in speculative decoding is this
agreement seen through blocks of K, so the two rank drafts alike; the probe costs seconds per
draft where the engine takes minutes, and it leaves the reported prompts untouched.

A draft is a model reference (hub id, folder, bundled name); ``--draft-vocab-from DIR`` gives the
drafts without a ``draft_vocab`` of their own the one in ``DIR/config.json`` (e.g. the untrained
0.5B with a trained run's 32k head).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch

from serving.engine import Request
from serving.engine.models import load_model, load_tokenizer
from serving.files import atomic_path
from training.evaluate import held_out_prompts
from training.generate import target_generate
from training.students import reduce_vocab


def continuations(target_ref: str, prompts: list[list[int]], new_tokens: int, cache: Path) -> list[list[int]]:
    """The target's greedy continuations of ``prompts``, cached in ``cache`` (regenerated if the
    target, the prompts or the length differ)."""
    if cache.exists():
        saved = torch.load(cache)
        if saved.get("target") == str(target_ref) and saved["prompts"] == prompts and saved["new_tokens"] == new_tokens:
            return saved["continuations"]
    target = load_model(target_ref)
    outs = target_generate(target, load_tokenizer(target_ref), [Request(p, max_new_tokens=new_tokens) for p in prompts],
                           desc="target continuations")  # fmt: skip
    done = [o.token_ids for o in outs]
    with atomic_path(cache) as tmp:
        torch.save({"target": str(target_ref), "prompts": prompts, "new_tokens": new_tokens, "continuations": done}, tmp)
    return done


@torch.no_grad()
def agreement(draft, prompts: list[list[int]], conts: list[list[int]], tokenizer=None, misses: int = 0) -> dict:
    """Share of continuation tokens the draft's argmax matches, and share its vocabulary holds;
    with ``misses`` > 0, also the most frequent (target token, draft token) disagreements."""
    vocab = getattr(draft.config, "draft_vocab", None)
    columns = torch.tensor(vocab) if vocab else None
    agree = covered = total = 0
    pairs: collections.Counter = collections.Counter()
    for p, c in zip(prompts, conts):
        logits = draft(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : len(p) - 1 + len(c)]  # [n, V]
        y = torch.tensor(c)  # [n]
        if columns is None:
            pred, held = logits.argmax(-1), torch.ones_like(y, dtype=torch.bool)
        else:
            pred, held = columns[logits[:, columns].argmax(-1)], torch.isin(y, columns)
        agree, covered, total = agree + int((pred == y).sum()), covered + int(held.sum()), total + len(c)
        if misses:
            pairs.update((tokenizer.decode([t]), tokenizer.decode([d])) for t, d in zip(y.tolist(), pred.tolist()) if t != d)
    result = {"agreement": agree / total, "vocab_coverage": covered / total, "tokens": total}
    if misses:
        result["top_misses"] = [{"target": t, "draft": d, "count": n} for (t, d), n in pairs.most_common(misses)]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("drafts", nargs="+", help="model references of the drafts to score")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--first", type=int, default=32, help="first HumanEval prompt used")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--draft-vocab-from", help="folder whose config.json draft_vocab applies to drafts without one")
    ap.add_argument("--out", default="runs/agreement-probe")
    ap.add_argument("--misses", type=int, default=15, help="most frequent disagreements to list per draft")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.target)
    prompts = held_out_prompts("code", args.first + args.prompts, tokenizer)[args.first :]
    conts = continuations(args.target, prompts, args.new_tokens, out / "continuations.pt")
    shared = None
    if args.draft_vocab_from:
        shared = json.loads((Path(args.draft_vocab_from) / "config.json").read_text()).get("draft_vocab")
    rows = []
    for ref in args.drafts:
        draft = load_model(ref)
        if shared and not getattr(draft.config, "draft_vocab", None):
            reduce_vocab(draft, shared)
        rows.append({"draft": ref} | agreement(draft.eval(), prompts, conts, tokenizer, args.misses))
        print(f"{ref}: agreement {rows[-1]['agreement']:.4f}, vocabulary coverage {rows[-1]['vocab_coverage']:.4f}", flush=True)
    (out / "probe.json").write_text(json.dumps({"humaneval_prompts": [args.first, args.first + len(prompts) - 1],
                                                "new_tokens": args.new_tokens, "rows": rows}, indent=1))  # fmt: skip
    table = ["| draft | agreement | vocabulary coverage | tokens |", "|---|---|---|---|"]
    table += [f"| {r['draft']} | {r['agreement']:.4f} | {r['vocab_coverage']:.4f} | {r['tokens']} |" for r in rows]
    for r in rows:
        if r.get("top_misses"):
            table += ["", f"{r['draft']}: most frequent disagreements (target token <- draft token, count)", ""]
            table += [f"- {m['target']!r} <- {m['draft']!r}: {m['count']}" for m in r["top_misses"]]
    (out / "probe.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
