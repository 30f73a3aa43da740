"""Smoke test on the real bundled pair (Qwen2.5-Coder-1.5B target, 0.5B draft): fp32, greedy,
2 prompts x 16 tokens, speculative output identical to the target alone. CI runs it and it must
not skip: a missing ``choral[bundled]`` install fails here with the install hint."""

import pytest

from serving.engine import EngineConfig, Request, SpeculativeEngine
from serving.engine.models import load_model, load_tokenizer

pytestmark = pytest.mark.bundled

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def test_bundled_pair_speculative_equals_target_alone():
    tokenizer = load_tokenizer(TARGET)
    target = load_model(TARGET)
    draft = load_model(DRAFT)
    prompts = [
        tokenizer.encode("def is_prime(n: int) -> bool:\n"),
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "What is 17 * 23?"}], tokenize=False, add_generation_prompt=True
            )
        ),
    ]
    requests = [Request(p, max_new_tokens=16) for p in prompts]
    alone = SpeculativeEngine(target, tokenizer, None, EngineConfig(max_len=256)).generate(requests)
    spec = SpeculativeEngine(target, tokenizer, draft, EngineConfig(max_len=256, k=4)).generate(requests)
    for a, s in zip(alone, spec):
        assert s.token_ids == a.token_ids, (a.text, s.text)
        assert len(a.token_ids) == 16 or a.finish_reason == "stop"
    assert sum(s.stats["accepted"] for s in spec) > 0  # the real draft is accepted at least sometimes
