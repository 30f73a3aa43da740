"""Held-out evaluation of a draft with the real engine: acceptance, tokens per target call and
speed, on evaluation prompts that training never sees (HumanEval for code; the head of the
ShareGPT and mathematics-dataset sequences for chat and math)."""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from serving.engine import EngineConfig, Request, SpeculativeEngine, use_cpu_kernels
from serving.prompts import encode_prompt, load_prompts


def held_out_prompts(domain: str, n: int, tokenizer: PreTrainedTokenizerBase, max_tokens: int = 384) -> list[list[int]]:
    """The first n evaluation prompts of a domain, tokenized, cut to their last ``max_tokens``."""
    return [encode_prompt(tokenizer, p)[-max_tokens:] for p in load_prompts(domain, n)]


@torch.no_grad()
def measure(
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    *,
    k: int = 4,
    max_new_tokens: int = 32,
    draft_weights: str = "fp32",
) -> dict:
    """Greedy decoding of every prompt; ``draft=None`` measures the target alone.
    ``draft_weights="int8"`` measures an int8 copy of the draft on Choral's CPU kernels (and
    prepares the target's kernels, which only apply to steps of at most 16 tokens, so training's
    long teacher forwards are unaffected)."""
    original, was_training = draft, draft.training if draft is not None else False
    if draft is not None:
        draft.eval()
    if draft_weights != "fp32":
        widths = EngineConfig(k=k, k_buckets=(k,)).step_widths
        if draft is not None:
            draft = copy.deepcopy(draft)
        use_cpu_kernels([target], drafts=[draft] if draft is not None else [], draft_weights=draft_weights,
                        device=target.device, dtype=target.dtype, widths=widths)
    max_len = max(len(p) for p in prompts) + max_new_tokens + k + 2
    engine = SpeculativeEngine(target, tokenizer, draft, EngineConfig(max_len=max_len, k=k if draft is not None else 0))
    outs = engine.generate([Request(p, max_new_tokens=max_new_tokens) for p in prompts])
    if was_training:
        original.train()
    stats = [o.stats for o in outs]
    drafted = sum(s["drafted"] for s in stats)
    calls = sum(s["target_calls"] for s in stats)
    seconds = sum(s["total_time_s"] for s in stats)
    draft_steps = sum(s["drafted"] for s in stats)  # one draft forward per drafted token
    return {
        "acceptance_rate": sum(s["accepted"] for s in stats) / drafted if drafted else 0.0,
        "tokens_per_target_call": sum(s["new_tokens"] - 1 for s in stats) / calls if calls else 0.0,
        "tokens_per_second": sum(s["new_tokens"] for s in stats) / seconds,
        "draft_step_ms": 1e3 * sum(s["draft_time_s"] for s in stats) / draft_steps if draft_steps else 0.0,
        "target_step_ms": 1e3 * sum(s["target_time_s"] for s in stats) / calls if calls else 0.0,
        "token_ids": [o.token_ids for o in outs],
    }
