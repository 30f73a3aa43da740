"""JSON schema under speculation (issue 72): a grammar row's output is the constrained target's.

Tier 3, tiny models: every drafter kind in batches mixed with unconstrained rows gives the greedy
output of the constrained target alone, which parses and follows the schema and ends with EOS
(``stop``) within its budget; seeded sampled rows are the same alone and batched; after every
step (rejections included) a row's matcher is where a fresh matcher fed the row's committed tokens
is. Tier 1: the masks and the compact whitespace policy on the tiny tokenizer.
"""

from __future__ import annotations

import json

import pytest
import torch

from serving.engine.core import SpeculativeEngine
from serving.engine.drafters.auto import AutoDrafter
from serving.engine.drafters.ngram import NgramDrafter
from serving.engine.drafters.suffix import SuffixDrafter
from serving.engine.engine_settings import EngineConfig
from serving.engine.grammar import GrammarError, apply_masks, grammars_for, json_schema_grammar
from serving.engine.request import Request
from serving.engine.sampling import SamplingParams
from tests.test_auto_drafter import COSTS
from tests.test_engine_tiny import ragged_prompts

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["ok", "color", "n"],
    "additionalProperties": False,
}  # fmt: skip
DRAFTERS = ["small", "ngram", "suffix", "auto", "none"]


def follows_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"ok", "color", "n"} and isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")
            and isinstance(value["n"], int) and 0 <= value["n"] <= 999)  # fmt: skip


@pytest.fixture(scope="module")
def engines(tiny_target, tiny_draft, tokenizer):
    drafters = {"small": tiny_draft, "ngram": NgramDrafter(), "suffix": SuffixDrafter(max_cached_requests=4),
                "auto": AutoDrafter(costs=COSTS), "none": None}  # fmt: skip
    config = EngineConfig(max_batch_size=4, max_len=256, k=4)
    alone = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=4, max_len=256, k=0))
    return SpeculativeEngine(tiny_target, tokenizer, config=config, drafters=drafters), alone


@pytest.mark.unit
def test_a_mask_allows_what_the_grammar_allows_and_nothing_past_the_tokenizer(tokenizer):
    g = grammars_for(tokenizer, 384)  # logits wider than the tokenizer's 320 tokens
    m = g.matcher(json_schema_grammar(SCHEMA))
    logits = torch.zeros(1, 2, 384)
    masked = apply_masks(logits, g.masks([(0, m, [])], 1, 2))
    allowed = torch.isfinite(masked[0, 0]).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).startswith("{") for t in allowed) and max(allowed) < len(tokenizer)
    assert torch.isfinite(masked[0, 1]).all()  # a position past the drafts: unconstrained (never read)


@pytest.mark.unit
def test_a_schema_that_cannot_compile_is_named(tokenizer):
    with pytest.raises(GrammarError, match="cannot be compiled"):
        json_schema_grammar({"type": "object", "properties": {"a": {"type": "no-such-type"}}})
    with pytest.raises(GrammarError, match="bytes; at most"):
        json_schema_grammar({"type": "object", "description": "x" * 300_000})


@pytest.mark.integration
def test_greedy_json_under_every_drafter_is_the_constrained_targets(engines):
    """Constrained rows (every drafter kind, a prediction too) beside unconstrained ones: each
    equals the constrained target alone, parses, follows the schema and ends with EOS."""
    engine, alone = engines
    params = SamplingParams(grammar=json_schema_grammar(SCHEMA))
    prompts = ragged_prompts(10, seed=81)
    requests, wants = [], []
    for i, prompt in enumerate(prompts):
        p = params if i % 2 == 0 else SamplingParams()
        [want] = alone.generate([Request(prompt, p, max_new_tokens=128)])
        wants.append(want)
        drafter = ([*DRAFTERS, "prediction"])[(i // 2) % 6]
        requests.append(Request(prompt, p, max_new_tokens=128, drafter=drafter,
                                prediction=want.token_ids if drafter == "prediction" else None))  # fmt: skip
    outs = engine.generate(requests)
    for i, (out, want) in enumerate(zip(outs, wants)):
        assert out.token_ids == want.token_ids, (i, requests[i].drafter)
        if i % 2 == 0:
            assert out.finish_reason == "stop" and follows_schema(out.text), out.text
            assert out.stats["processors"] == ["grammar"]
    assert sum(o.stats["drafted"] for o in outs[::2]) > 0


@pytest.mark.integration
def test_seeded_json_is_the_same_alone_and_batched(engines):
    engine, _ = engines
    grammar = json_schema_grammar(SCHEMA)
    requests = [Request(p, SamplingParams(temperature=1.0, seed=i, grammar=grammar if i % 2 == 0 else None), max_new_tokens=96,
                        drafter=DRAFTERS[i % 5]) for i, p in enumerate(ragged_prompts(6, seed=82))]  # fmt: skip
    solo = [engine.generate([r])[0].token_ids for r in requests]
    batched = engine.generate(requests)
    assert [o.token_ids for o in batched] == solo
    for out in batched[::2]:
        assert out.finish_reason == "stop" and follows_schema(out.text), out.text


@pytest.mark.integration
def test_after_every_step_a_rows_matcher_is_where_its_committed_tokens_put_it(engines, tokenizer):
    """Drafts the grammar rejects and drafts the target rejects never move a matcher: after each
    step, its mask is the mask of a fresh matcher fed the row's committed tokens."""
    engine, _ = engines
    grammar = json_schema_grammar(SCHEMA)
    g = grammars_for(tokenizer, engine.vocab_size)
    ids = [engine.add_request(Request(p, SamplingParams(grammar=grammar), max_new_tokens=96, drafter=d))
           for p, d in zip(ragged_prompts(3, seed=83), ["ngram", "small", "auto"])]  # fmt: skip
    generated: dict[int, list[int]] = {i: [] for i in ids}
    checked = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated[out.request_id] += out.new_token_ids
        for b, slot in enumerate(engine._slots):
            if slot is None:
                continue
            fresh = g.matcher(grammar)
            assert fresh.consume_tokens(generated[slot.index])
            mine = engine.processors.matchers[b]
            assert torch.equal(g.masks([(0, mine, [])], 1, 1), g.masks([(0, fresh, [])], 1, 1))
            checked += 1
    assert checked > 5


@pytest.mark.integration
def test_the_grammars_forced_tokens_are_free_drafts_never_rejected(engines):
    """Where the schema forces the next tokens (keys, punctuation), they are proposed as drafts of
    the ``grammar`` proposer: counted apart in the statistics and the token origins, and never
    rejected (the mask allows the canonical tokens only); the output is still the target's."""
    engine, alone = engines
    params = SamplingParams(grammar=json_schema_grammar(SCHEMA))
    prompts = ragged_prompts(4, seed=84)
    outs = engine.generate([Request(p, params, max_new_tokens=128, drafter=d) for p, d in zip(prompts, ["ngram", "small", "none", "auto"])])
    wants = alone.generate([Request(p, params, max_new_tokens=128) for p in prompts])
    assert [o.token_ids for o in outs] == [w.token_ids for w in wants]
    forced = 0
    for out in outs:
        origins = out.origins
        for i, o in enumerate(origins):
            if o.origin == "draft" and o.drafter == "grammar":
                forced += 1
                after = next((x for x in origins[i + 1:] if not (x.origin == "draft" and x.drafter == "grammar")), None)
                assert after is None or after.origin != "correction", "a forced draft was rejected"
        if out.stats["drafter"] != "none":
            assert out.stats["drafter_shares"].get("grammar", 0) > 0
    assert forced >= 8
