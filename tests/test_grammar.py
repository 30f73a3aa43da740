"""JSON schema under speculation (issue 72): a grammar row's output is the constrained target's.

Tier 3, tiny models: every drafter kind in batches mixed with unconstrained rows gives the greedy
output of the constrained target alone, which parses and follows the schema and ends with EOS
(``stop``) within its budget; seeded sampled rows are the same alone and batched; after every
step (rejections included) a row's matcher is where a fresh matcher fed the row's committed tokens
is. Tier 1: the masks and the compact whitespace policy on the tiny tokenizer.
"""

from __future__ import annotations

import copy
import itertools
import json

import llguidance
import pytest
import torch

from serving.engine.core import SpeculativeEngine
from serving.engine.drafters.auto import AutoDrafter
from serving.engine.drafters.grammar import GrammarDrafter
from serving.engine.drafters.ngram import NgramDrafter
from serving.engine.drafters.suffix import SuffixDrafter
from serving.engine.engine_settings import EngineConfig
from serving.engine.grammar import GrammarError, Grammars, apply_masks, grammars_for, json_schema_grammar
from serving.engine.processors import ProcessorRows, Processors, process
from serving.engine.request import Request
from serving.engine.sampling import SamplingParams, SamplingTensors, probs_from_logits
from serving.engine.speculative import speculative_step, step_uniforms
from tests.stubs import MarkovStub, state_for
from tests.test_auto_drafter import COSTS
from tests.test_engine_tiny import ragged_prompts

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["ok", "color", "n"],
    "additionalProperties": False,
}  # fmt: skip
DRAFTERS = ["small", "ngram", "suffix", "auto", "grammar", "none"]


def follows_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"ok", "color", "n"} and isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")
            and isinstance(value["n"], int) and 0 <= value["n"] <= 999)  # fmt: skip


@pytest.fixture(scope="module")
def engines(tiny_target, tiny_draft, tokenizer):
    drafters = {"small": tiny_draft, "ngram": NgramDrafter(), "suffix": SuffixDrafter(max_cached_requests=4),
                "auto": AutoDrafter(costs=COSTS), "grammar": GrammarDrafter(), "none": None}  # fmt: skip
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
def test_a_gguf_vocabularys_padding_rows_are_never_allowed_inside_a_string(tokenizer):
    """A GGUF-converted tokenizer names the embedding's padding rows "[PAD<id>]" (the bundled
    Qwen's 271): plain text to llguidance, which would let them into a JSON string."""
    padded = copy.deepcopy(tokenizer)
    n = len(padded)
    padded.add_tokens([f"[PAD{i}]" for i in range(n, n + 4)])
    g = grammars_for(padded, 384)
    assert g.padding == list(range(n, n + 4))
    m = g.matcher(json_schema_grammar({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}))
    assert m.consume_tokens(padded.encode('{"a": "', add_special_tokens=False))
    masked = apply_masks(torch.zeros(1, 1, 384), g.masks([(0, m, [])], 1, 1))  # [1, 1, V]
    assert torch.isfinite(masked[0, 0, :n]).sum() > 100  # any text goes in the string ...
    assert not torch.isfinite(masked[0, 0, n:]).any()  # ... but never a padding row


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["json", "token ids"])
def test_masks_along_drafts_leave_the_matcher_where_it_was(tokenizer, kind):
    """The draft walk never moves the row's matcher, for a text grammar and for a grammar of token
    ids (``<[id]>``, as a tool call's special tags are written), where llguidance 1.9.1's rollback
    and draft-aware fill left the matcher advanced."""
    ids = tokenizer.encode('{"ok":true,"color":"red","n":5}', add_special_tokens=False)
    grammar = json_schema_grammar(SCHEMA) if kind == "json" else llguidance.grammar_from(
        "lark", "start: " + " ".join(f"<[{t}]>" for t in ids))  # fmt: skip
    g = grammars_for(tokenizer, 384)
    m = g.matcher(grammar)
    assert m.consume_token(ids[0])
    masks = g.masks([(0, m, ids[1:4])], 1, 4)  # [4, W]
    rows = apply_masks(torch.zeros(1, 4, 384), masks)[0]  # [4, V]
    assert all(torch.isfinite(rows[i, ids[1 + i]]) for i in range(4))  # each draft's own position allows the next token
    assert m.consume_tokens(ids[1:5]) and not m.is_error()


@pytest.mark.unit
def test_json_is_one_line_with_json_dumps_separators(tokenizer):
    """The whitespace policy: ``", "`` and ``": "`` (as json.dumps writes, and as the models write
    unconstrained), nothing else outside strings: no compact separators, no padding, no newlines."""
    g = grammars_for(tokenizer, 384)

    def accepted(text: str) -> bool:
        m = g.matcher(json_schema_grammar(SCHEMA))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()  # the whole text, and the grammar may end there

    assert accepted(json.dumps({"ok": True, "color": "red", "n": 5}))
    for bad in ('{"ok":true,"color":"red","n":5}', '{ "ok": true, "color": "red", "n": 5}',
                '{"ok": true,\n"color": "red", "n": 5}', '{"ok": true, "color": "red", "n": 5} '):
        assert not accepted(bad), bad


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
    prompts = ragged_prompts(14, seed=81)
    requests, wants = [], []
    for i, prompt in enumerate(prompts):
        p = params if i % 2 == 0 else SamplingParams()
        [want] = alone.generate([Request(prompt, p, max_new_tokens=128)])
        wants.append(want)
        drafter = ([*DRAFTERS, "prediction"])[(i // 2) % 7]
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
                        drafter=DRAFTERS[i % 6]) for i, p in enumerate(ragged_prompts(6, seed=82))]  # fmt: skip
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
    prompts = ragged_prompts(5, seed=84)
    outs = engine.generate([Request(p, params, max_new_tokens=128, drafter=d) for p, d in zip(prompts, ["ngram", "small", "none", "auto", "grammar"])])
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




@pytest.mark.unit
def test_a_device_proposal_is_kept_where_it_begins_with_the_forced_tokens():
    """``merge`` joins a device drafter's rows with their grammar's forced tokens: row 0's proposal
    begins with them (kept whole, past them too), row 1's does not (the forced tokens replace it),
    row 2 has none forced, row 3's proposal is shorter than its forced tokens (replaced)."""
    from serving.engine.drafters.base import Proposal
    from serving.engine.drafting import merge

    V = 16
    tokens = torch.tensor([[3, 4, 5, 6], [3, 9, 5, 6], [7, 7, 7, 7], [3, 0, 0, 0]])  # [B, K]
    q = torch.softmax(torch.randn(4, 4, V), -1)  # [B, K, V]
    proposal = Proposal(tokens, q, torch.tensor([4, 4, 4, 1]))
    out, q_out, n, joined = merge([[], [], [], []], [(proposal, torch.ones(4, dtype=torch.bool))], (1, 2, 4, 8), V,
                                  torch.device("cpu"), {0: [3, 4], 1: [3, 4], 3: [3, 4]})  # fmt: skip
    assert joined.tolist() == [True, False, True, False]
    assert out[0].tolist() == [3, 4, 5, 6] and n[0] == 4 and torch.equal(q_out[0], q[0])
    assert out[1, :2].tolist() == [3, 4] and n[1] == 2 and q_out[1, 1, 4] == 1.0  # point masses
    assert out[2].tolist() == [7, 7, 7, 7] and n[2] == 4
    assert out[3, :2].tolist() == [3, 4] and n[3] == 2


@pytest.mark.integration
def test_a_host_drafters_proposal_carries_on_past_the_forced_tokens(engines, tiny_target, tokenizer):
    """A ``prediction`` of the constrained answer begins with every forced run: joined, its drafts
    go past the forced tokens: the row takes about one target call per K + 1 tokens (with the forced
    tokens alone in their steps, a step ends at the end of each forced run: 6 calls where 4 do)."""
    _, alone = engines
    engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=4, max_len=256, k=8),
                               drafters={"ngram": NgramDrafter()})  # a prediction drafter comes with any host drafter
    params = SamplingParams(grammar=json_schema_grammar(SCHEMA))
    prompts = ragged_prompts(3, seed=86)
    wants = alone.generate([Request(p, params, max_new_tokens=128) for p in prompts])
    requests = [Request(p, params, max_new_tokens=128, drafter="prediction", prediction=w.token_ids) for p, w in zip(prompts, wants)]
    joined = engine.generate(requests)
    assert [o.token_ids for o in joined] == [w.token_ids for w in wants]
    for out, want in zip(joined, wants):
        assert out.stats["target_calls"] <= -(-len(want.token_ids) // (engine.config.k + 1)), out.stats  # forced alone: 6 for 4
        assert out.stats["drafter_shares"].get("prediction", 0) > 0


@pytest.mark.integration
def test_a_logit_bias_ban_never_empties_the_grammars_choices(engines, tokenizer):
    """``logit_bias`` -100 lowers a token by 100 (OpenAI's bias, added to the logit), and the mask
    keeps what the grammar allows: where a bias bans every token the grammar allows (here each
    opening token of the object), the row still takes one of them and finishes valid, with
    ``stop``; no position is left without a token."""
    engine, alone = engines
    grammar = json_schema_grammar(SCHEMA)
    g = grammars_for(tokenizer, engine.vocab_size)
    first = torch.isfinite(apply_masks(torch.zeros(1, 1, engine.vocab_size), g.masks([(0, g.matcher(grammar), [])], 1, 1)))
    opening = first[0, 0].nonzero().flatten().tolist()  # every token the grammar allows first
    params = SamplingParams(grammar=grammar, logit_bias=tuple((t, -100.0) for t in opening))
    prompts = ragged_prompts(2, seed=87)
    outs = engine.generate([Request(p, params, max_new_tokens=128, drafter=d) for p, d in zip(prompts, ["grammar", "small"])])
    wants = alone.generate([Request(p, params, max_new_tokens=128) for p in prompts])
    for out, want in zip(outs, wants):
        assert out.token_ids == want.token_ids and out.token_ids[0] in opening
        assert out.finish_reason == "stop" and follows_schema(out.text), out.text


@pytest.mark.integration
def test_a_stop_string_cuts_the_json_as_it_cuts_any_text(engines):
    """A stop string inside the constrained answer ends it there (``stop``, the text before the
    string: cut JSON, as OpenAI cuts it), every drafter alike."""
    engine, alone = engines
    params = SamplingParams(grammar=json_schema_grammar(SCHEMA))
    prompts = ragged_prompts(3, seed=88)
    outs = engine.generate([Request(p, params, max_new_tokens=128, drafter=d, stop=('"color"',)) for p, d in zip(prompts, ["grammar", "small", "suffix"])])
    wants = alone.generate([Request(p, params, max_new_tokens=128, stop=('"color"',)) for p in prompts])
    for out, want in zip(outs, wants):
        assert out.text == want.text and out.finish_reason == "stop" and out.text.startswith('{"ok": ') and out.text.endswith(", "), out.text

@pytest.mark.integration
def test_threshold_rows_never_accept_a_token_the_grammar_masks(tiny_target, tokenizer):
    """Threshold verification reads the masked p: a draft the grammar forbids (here "Q", which no
    value of the schema holds) is never accepted, however low the threshold."""
    from serving.engine.drafters.base import HostDrafter

    [banned] = tokenizer.encode("Q", add_special_tokens=False)

    class Forbidden(HostDrafter):
        def propose(self, row, tokens, k):
            return [banned] * k

    engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=2, max_len=256, k=3),
                               drafters={"forbidden": Forbidden()})  # fmt: skip
    params = SamplingParams(verification="threshold", verification_threshold=1e-9, grammar=json_schema_grammar(SCHEMA))
    outs = engine.generate([Request(p, params, max_new_tokens=128, drafter="forbidden") for p in ragged_prompts(2, seed=85)])
    for out in outs:
        assert banned not in out.token_ids and out.finish_reason == "stop" and follows_schema(out.text), out.text
        mine = [o for o in out.origins if o.origin == "draft" and o.drafter == "forbidden"]
        assert not mine and out.stats["drafter_shares"].get("forbidden", 0) > 0  # it drafted, and lost every time

# ---- tier 4: sampled output follows the constrained target --------------------------------------

V5, M, N = 5, 3, 20_000
LARK = 'start: "b" ("a" | "b" "c" | "d" "a")+\n'  # the chain starts at "b" (token 1); "b" forces "c", "d" forces "a"


def five_token_tokenizer():
    """A byte-level tokenizer of a, b, c, d and an EOS: llguidance's view of the Markov chain's tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "c": 2, "d": 3, "<e>": 4}, merges=[], unk_token="<e>"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<e>")


def constrained_distribution(p_table, params, tok):
    """P(x_1..x_M | prefix [0, 1]) under the target masked by the grammar, by enumeration (an EOS
    stops the grammar: only EOS follows it)."""
    g = grammars_for(tok, V5)
    probs = {}
    for seq in itertools.product(range(V5), repeat=M):
        prob, history = 1.0, [1]
        for x in seq:
            m = g.matcher(params.grammar)
            assert m.consume_tokens(history)
            rows = ProcessorRows.empty(1, V5, "cpu", grammar=[(0, m)], grammars=g)
            logits = process(p_table[history[-1]].view(1, 1, V5), rows)  # [1, 1, V]
            prob *= probs_from_logits(logits, SamplingTensors.build([params], "cpu"))[0, 0, x].item()
            if prob == 0:
                break
            history.append(x)
        probs[seq] = prob
    return probs


def chi_p(samples, probs):
    """The chi-square p-value of the samples' M-token sequences against ``probs`` (expected counts
    under 5 pooled); 0 when a sample lies outside the support (a token the grammar masks, drawn)."""
    from scipy.stats import chisquare

    n = samples.shape[0]
    codes = (samples * V5 ** torch.arange(M - 1, -1, -1)).sum(1)  # [N] each sequence's index in product order
    counts = torch.bincount(codes, minlength=V5**M).float()
    expected = torch.tensor(list(probs.values())) * n
    if counts[expected == 0].sum() > 0:
        return 0.0
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    return chisquare(obs.numpy(), exp.numpy() * (n / exp.sum().item())).pvalue


def constrained_samples(p_table, q_table, params, K, seed, tok):
    """N sequences of M tokens after [0, 1] through ``speculative_step`` with the engine's processor
    state: each row's matcher started at token 1 and moved by ``observe`` with what each step committed."""
    target, draft = MarkovStub(p_table), MarkovStub(q_table)
    state = state_for([[0, 1]] * N, capacity=2 + M + K + 8, limit=M + K + 4, eos=[])
    processors = Processors(N, V5, torch.device("cpu"), tok)
    for b in range(N):
        processors.start(b, params, [0], 1)
    generators = [torch.Generator().manual_seed(seed * N + i) for i in range(N)]
    while int(state.lengths.min()) < 2 + M:
        sampling = SamplingTensors.build([params] * N, "cpu", processors.rows(N, [params] * N))
        before = state.lengths.clone()
        rand = step_uniforms(generators, [K] * N, K, "cpu")
        _, n_new, k = speculative_step(target, draft, state, sampling, rand, K)
        committed = state.tokens.gather(1, before.unsqueeze(1) + torch.arange(k + 1))  # [N, k + 1]
        for b, (row, n) in enumerate(zip(committed.tolist(), n_new.tolist())):
            processors.observe(b, row[:n])
    return state.tokens[:, 2 : 2 + M]


@pytest.mark.slow
def test_sampled_output_follows_the_constrained_target():
    """Drafts from an unconstrained q (the grammar forbids many): the output is distributed as the
    target masked by the grammar alone, with power against masks that ignore the drafts before a
    position (every position masked as the row's first)."""
    tok = five_token_tokenizer()
    params = SamplingParams(temperature=1.0, grammar=llguidance.grammar_from("lark", LARK))
    g = torch.Generator().manual_seed(31)
    p_table, q_table = torch.randn(V5, V5, generator=g) * 1.5, torch.randn(V5, V5, generator=g) * 1.5
    exact = constrained_distribution(p_table, params, tok)
    assert chi_p(constrained_samples(p_table, q_table, params, 3, 5, tok), exact) > 1e-3

    real = Grammars.masks
    blind = lambda self, matchers, B, T: real(self, [(b, m, []) for b, m, _ in matchers], B, 1).repeat_interleave(T, 0)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Grammars, "masks", blind)
        assert chi_p(constrained_samples(p_table, q_table, params, 3, 6, tok), exact) < 1e-6
