"""Fixtures for the routing tests: prompt files of two domains and tiny drafts that each agree
with the tiny target on one domain only.

How the drafts differ by domain: the target's greedy continuations of code prompts and of math
prompts use partly different tokens. ``draft_code`` is the target with the output-embedding rows
of the math-only tokens permuted among themselves: wherever the target's next token is not a
math-only token the draft's argmax is the target's (the largest logit and its token are
unchanged), and wherever it is one the draft proposes another token. So draft_code is accepted
fully on code prompts and often rejected on math prompts; ``draft_math`` is the mirror image.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

from serving.engine import EngineConfig, Request, SpeculativeEngine
from serving.prompts import Prompt, encode_prompt
from tests.conftest import make_tokenizer, tiny_qwen2

_NAMES = ["add", "total", "parse", "load", "walk", "merge", "count", "scale", "split", "join", "flip", "sum"]
_WORDS = ["plus", "times", "minus", "divided by"]


def domain_prompts(n: int, seed: int = 0) -> dict[str, list[Prompt]]:
    """n code-like prompts (raw completions) and n math-like questions (chat template)."""
    rng = random.Random(seed)
    code = [
        Prompt("code", f"code/{i}", f"def {rng.choice(_NAMES)}_{i}(x, y):\n    return x {rng.choice('+-*')} y * {i}\n", False)
        for i in range(n)
    ]  # fmt: skip
    math = [
        Prompt("math", f"math/{i}", f"What is {rng.randint(2, 99)} {rng.choice(_WORDS)} {rng.randint(2, 99)}? Give the answer.")
        for i in range(n)
    ]  # fmt: skip
    return {"code": code, "math": math}


def write_prompt_file(path: Path, prompts: list[Prompt]) -> Path:
    rows = [{"id": p.id, "domain": p.domain, "text": p.text, "use_chat_template": p.use_chat_template} for p in prompts]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _greedy_tokens(target, tokenizer, prompts: list[Prompt], new_tokens: int) -> set[int]:
    engine = SpeculativeEngine(target, tokenizer, None, EngineConfig(max_batch_size=4, max_len=256, k=1, k_buckets=(1,)))
    outs = engine.generate([Request(encode_prompt(tokenizer, p), max_new_tokens=new_tokens) for p in prompts])
    return {t for o in outs for t in o.token_ids}


def _permuted_rows(target: Qwen2ForCausalLM, tokens: list[int]) -> Qwen2ForCausalLM:
    draft = Qwen2ForCausalLM(target.config).eval()
    draft.load_state_dict(target.state_dict())
    if len(tokens) > 1:
        with torch.no_grad():
            w = draft.lm_head.weight  # [V, H]
            w[tokens] = w[tokens[1:] + tokens[:1]].clone()
    return draft


def domain_models(root: Path, prompts: dict[str, list[Prompt]], new_tokens: int) -> dict[str, Path]:
    """Target, draft_code and draft_math saved as Hugging Face folders under ``root``."""
    tokenizer = make_tokenizer()
    target = tiny_qwen2(0)
    code = _greedy_tokens(target, tokenizer, prompts["code"], new_tokens)
    math = _greedy_tokens(target, tokenizer, prompts["math"], new_tokens)
    models = {
        "target": target,
        "draft_code": _permuted_rows(target, sorted(math - code)),
        "draft_math": _permuted_rows(target, sorted(code - math)),
    }
    dirs = {}
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs
