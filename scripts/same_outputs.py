"""Greedy output of every drafter on the bundled pair, written as JSON, or compared with an earlier run.

    python scripts/same_outputs.py --out before.json          # before a change
    python scripts/same_outputs.py --compare before.json      # after it: exits 1 on any difference

A refactor of the engine must not move a single token: this runs the bundled target alone and with
each drafter kind (the bundled draft model, ``ngram``, ``suffix``, ``prediction``) on six prompts
in one batch of two rows, so rows share steps with other drafters, and keeps each output's token
ids. Greedy identity with the target alone is checked too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences why the sky is blue.",
    "What is 17 * 23? Show the steps.",
    "Rewrite this so it uses a list comprehension:\nresult = []\nfor x in xs:\n    if x > 0:\n        result.append(x * 2)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]
DRAFTERS = {"none": "none", "base": "qwen2.5-coder-0.5b-instruct", "ngram": "ngram", "suffix": "suffix"}


def run(target: str, max_new_tokens: int) -> dict[str, list[list[int]]]:
    from serving.engine import Request
    from serving.engine.engine_settings import EngineSettings
    from serving.engine.loader import load_engine

    settings = EngineSettings(device="cpu", max_batch_size=2, max_len=512, k=4)
    loaded = load_engine(settings, target, DRAFTERS)
    tok, engine = loaded.tokenizer, loaded.engine
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False) for p in PROMPTS]
    ids = [tok.encode(c, add_special_tokens=False) for c in chats]
    out: dict[str, list[list[int]]] = {}
    for name in [*DRAFTERS, "prediction"]:
        drafter = None if name == "prediction" else name
        # the prediction drafter's requests carry a prediction: the prompt's own text, as an editing client sends
        requests = [Request(p, max_new_tokens=max_new_tokens, drafter=drafter, prediction=p if name == "prediction" else None)
                    for p in ids]  # fmt: skip
        out[name] = [c.token_ids for c in engine.generate(requests)]
        print(f"{name}: {sum(map(len, out[name]))} tokens", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, help="write the outputs here")
    ap.add_argument("--compare", type=Path, help="an earlier --out file: exit 1 if any output differs")
    args = ap.parse_args(argv)
    out = run(args.target, args.max_new_tokens)
    bad = [n for n in out if out[n] != out["none"]]
    if bad:
        print(f"not the target's greedy output: {bad}", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(out))
    if args.compare:
        before = json.loads(args.compare.read_text())
        moved = [n for n in before if before[n] != out.get(n)]
        print(f"compared with {args.compare}: " + (f"differ: {moved}" if moved else f"all {len(before)} drafters identical"))
        bad += moved
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
