"""Held-out evaluation of a draft with the real engine: acceptance, tokens per target call and
speed, on evaluation prompts that training never sees (HumanEval for code; the head of the
ShareGPT and mathematics-dataset sequences for chat and math)."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from serving.engine import Request
from serving.engine.devices import release_host_memory
from serving.engine.engine_settings import EngineSettings
from serving.engine.loader import build_engine, prepare_kernels
from serving.prompts import encode_prompt, load_prompts
from training.config import EvalConfig
from training.students import shared_copy


def held_out_prompts(domain: str, n: int, tokenizer: PreTrainedTokenizerBase, max_tokens: int = 384) -> list[list[int]]:
    """The first n evaluation prompts of a domain, tokenized, cut to their last ``max_tokens``."""
    return [encode_prompt(tokenizer, p)[-max_tokens:] for p in load_prompts(domain, n)]


def measure(
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    settings: EngineSettings | None = None,
    *,
    max_new_tokens: int = 32,
) -> dict:
    """Greedy decoding of every prompt with the engine of ``settings`` (default: train-draft's
    ``eval.engine``); ``draft=None`` measures the target alone. The models run where they are.
    With ``cpu_kernels`` (and ``draft_weights="int8"``) the engine runs a copy of the draft on
    Choral's CPU kernels (int8), never the model being trained; the target's kernels only apply
    to steps of at most 16 tokens, so training's long teacher forwards are unaffected."""
    settings = settings or EvalConfig().engine
    original, was_training = draft, draft.training if draft is not None else False
    if draft is not None:
        draft.eval()
    k_max = max(settings.k_buckets) if settings.k == "auto" else settings.k
    max_len = settings.max_len or max(len(p) for p in prompts) + max_new_tokens + k_max + 2
    if settings.uses_cpu_kernels:
        flags = [(p, p.requires_grad) for p in draft.parameters()] if draft is not None else []
        if draft is not None:
            draft = shared_copy(draft)  # the kernels swap modules in place: never the trained model's
        widths = settings.engine_config(draft=True, device=target.device).step_widths  # what a draft's steps use
        # The copy shares the trained model's fp32 tensors, whose file mapping training keeps anyway.
        prepare_kernels(settings, [target], [draft] if draft is not None else [], widths, device=target.device,
                        dtype=target.dtype, own_draft_tensors=False)  # fmt: skip
        for p, flag in flags:  # the kernels freeze parameters; the shared ones are still being trained
            p.requires_grad_(flag)
    engine = build_engine(settings, tokenizer, target, {"draft": draft} if draft is not None else {}, max_len=max_len)
    outs = engine.generate([Request(p, max_new_tokens=max_new_tokens) for p in prompts])
    if was_training:
        original.train()
    del engine, draft
    release_host_memory()  # the engine's caches and the draft's int8 copy: training needs the room back
    return summarize(outs)


def summarize(outs) -> dict:
    """Acceptance, tokens per target call, speed and step costs of an engine's completions."""
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
