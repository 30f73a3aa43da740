"""Smoke test on the real bundled pair (Qwen2.5-Coder-1.5B target, 0.5B draft) at the defaults a
new user gets on a CPU: the q4 target (the GGUF's own 4-bit groups) and the q4 draft, greedy,
2 prompts x 16 tokens, speculative output identical to the same q4 target decoding alone, and the
line every command prints (``spec-generate`` and ``serve`` through ``load_engine``) saying so. CI
runs it and it must not skip: a missing
``choral[bundled]`` install fails here with the install hint."""

import pytest

from serving.engine import Request
from serving.engine.cpu_kernels import rowdot_available
from serving.engine.engine_settings import EngineSettings
from serving.engine.loader import load_engine

pytestmark = pytest.mark.bundled

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def test_bundled_pair_at_the_default_precision_equals_its_target_alone(capsys):
    settings = EngineSettings(device="cpu", max_len=256, k=4)  # precisions left at auto
    expected = "q4" if rowdot_available() else "fp32"
    assert settings.resolved(TARGET).target_weights == expected
    loaded = load_engine(settings, TARGET, {"draft": DRAFT, "none": None})
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith(f"target {TARGET}:")]  # loading bars beside it
    assert line.startswith(f"target {TARGET}: {expected}") and f"identical to the {expected} target decoding alone" in line
    tokenizer, engine = loaded.tokenizer, loaded.engine
    prompts = [
        tokenizer.encode("def is_prime(n: int) -> bool:\n"),
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "What is 17 * 23?"}], tokenize=False, add_generation_prompt=True
            )
        ),
    ]
    alone = engine.generate([Request(p, max_new_tokens=16, drafter="none") for p in prompts])
    spec = engine.generate([Request(p, max_new_tokens=16, drafter="draft") for p in prompts])
    for a, s in zip(alone, spec):
        assert s.token_ids == a.token_ids, (a.text, s.text)
        assert len(a.token_ids) == 16 or a.finish_reason == "stop"
    assert sum(s.stats["accepted"] for s in spec) > 0  # the real draft is accepted at least sometimes

