"""Logits processors and logprobs, exact under speculation (issue 71).

Tier 1: the processors agree with transformers' own (``RepetitionPenaltyLogitsProcessor``,
``SequenceBiasLogitsProcessor``, ``MinPLogitsWarper``) and with OpenAI's definition of the
frequency and presence penalties, on the same logits and histories; one verify's K + 1 positions
are processed as K + 1 single positions whose histories hold the drafts before them.
Tier 3: every drafter kind, in batches mixed with rows that use no processor: greedy output equal
to the target alone with the same processors (and to transformers' ``generate`` with its own
processors), seeded output equal alone and batched, logprobs equal to the target-alone path's.
Tier 4: sampled output follows the processed target's distribution (joint chi-square over three
tokens of a Markov chain, through the step and the engine's processor state), with power against
penalties that ignore the drafts before a position, a bonus drawn from the unprocessed p, and an
accept test whose q is not the q that drew the token.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor)  # fmt: skip
from transformers.generation.logits_process import LogitsProcessor

import serving.engine.speculative as speculative
from serving.engine.core import SpeculativeEngine
from serving.engine.drafters.auto import AutoDrafter
from serving.engine.drafters.ngram import NgramDrafter
from serving.engine.drafters.suffix import SuffixDrafter
from serving.engine.engine_settings import EngineConfig
from serving.engine.processors import Processors, ProcessorRows, fill_row, process
from serving.engine.request import Request
from serving.engine.sampling import SamplingParams, SamplingTensors, probs_from_logits
from serving.engine.speculative import speculative_step, step_uniforms
from tests.stubs import MarkovStub, state_for
from tests.test_auto_drafter import COSTS
from tests.test_engine_tiny import EOS, ragged_prompts

PROCESSORS = {  # one setting per processor, strong enough to move greedy output
    "logit_bias": dict(logit_bias=((7, 5.0), (11, -100.0), (40, 3.0))),
    "repetition_penalty": dict(repetition_penalty=1.8),
    "frequency_penalty": dict(frequency_penalty=1.5),
    "presence_penalty": dict(presence_penalty=2.0),
    "min_p": dict(min_p=0.2),
    "all": dict(logit_bias=((7, 2.0),), repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.5, min_p=0.1),
}


def rows_for(params: list[SamplingParams], histories: list[tuple[list[int], list[int]]], V: int) -> ProcessorRows:
    """ProcessorRows for rows with (prompt, generated) histories."""
    B = len(params)
    rows = ProcessorRows.empty(B, V, "cpu")
    for b, (p, (prompt, generated)) in enumerate(zip(params, histories)):
        fill_row(rows, b, p, prompt, generated)
    return rows


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's definition, written as transformers writes a processor: over generated tokens only,
    logit - frequency * count - presence * (count > 0)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for b, ids in enumerate(input_ids.tolist()):
            for token, count in Counter(ids[self.prompt_len :]).items():
                scores[b, token] -= self.frequency * count + self.presence
        return scores


def hf_processors(params: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    out = LogitsProcessorList()
    if params.logit_bias:
        out.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}))
    if params.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        out.append(OpenAIPenalties(prompt_len, params.frequency_penalty, params.presence_penalty))
    return out


# ---- tier 1: the processors, on hand-made logits -----------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("name", [n for n in PROCESSORS if n != "min_p"])
def test_processors_agree_with_transformers_and_openai_definitions(name):
    V = 60
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(**PROCESSORS[name])
    prompt, generated = torch.randint(0, V, (12,), generator=g).tolist(), torch.randint(0, V, (9,), generator=g).tolist()
    generated += generated[:3]  # repeats: counts above 1
    logits = torch.randn(1, 1, V, generator=g) * 3
    ours = process(logits, rows_for([params], [(prompt, generated)], V))[0, 0]
    ids = torch.tensor([prompt + generated])
    theirs = hf_processors(params, len(prompt))(ids, logits[:, 0].clone())[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.unit
def test_min_p_agrees_with_transformers_after_temperature():
    V = 60
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 1, V, generator=g) * 3
    params = [SamplingParams(temperature=0.8, min_p=0.15), SamplingParams(temperature=1.3, min_p=0.05)]
    ours = probs_from_logits(logits, SamplingTensors.build(params, "cpu"))
    for b, p in enumerate(params):
        warped = MinPLogitsWarper(p.min_p)(None, logits[b] / p.temperature)
        torch.testing.assert_close(ours[b], warped.softmax(-1), rtol=0, atol=1e-6)


@pytest.mark.unit
@pytest.mark.parametrize("name", list(PROCESSORS))
def test_each_verified_position_is_processed_with_the_drafts_before_it(name):
    """One call over K + 1 positions equals K + 1 calls of one position each, position t's history
    holding the row's real drafts before t (duplicates among them, padding past n_draft ignored)."""
    V, K = 40, 5
    g = torch.Generator().manual_seed(5)
    params = [SamplingParams(**PROCESSORS[name]), SamplingParams(), SamplingParams(**PROCESSORS[name])]
    histories = [(torch.randint(0, V, (6,), generator=g).tolist(), torch.randint(0, V, (4,), generator=g).tolist()) for _ in params]
    drafts = torch.randint(0, 8, (3, K), generator=g)  # few ids: drafts repeat each other and the history
    n_draft = torch.tensor([5, 2, 0])
    logits = torch.randn(3, K + 1, V, generator=g) * 3
    together = process(logits, rows_for(params, histories, V), drafts, n_draft)
    for b, (p, (prompt, generated)) in enumerate(zip(params, histories)):
        for t in range(K + 1):
            seen = drafts[b, : min(t, int(n_draft[b]))].tolist()
            alone = process(logits[b : b + 1, t : t + 1], rows_for([p], [(prompt, generated + seen)], V))
            torch.testing.assert_close(together[b, t], alone[0, 0], rtol=0, atol=0)


@pytest.mark.unit
def test_bad_processor_settings_name_the_field():
    for kwargs, field in [(dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=-3), "presence_penalty"),
                          (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
                          (dict(logprobs=21), "logprobs"), (dict(logit_bias=((5, 101.0),)), "logit_bias")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


# ---- tier 3: every drafter, mixed batches, tiny models -----------------------------------------


def every_drafter_engine(target, draft, tokenizer, batch=4, k=4):
    drafters = {"small": draft, "ngram": NgramDrafter(), "suffix": SuffixDrafter(max_cached_requests=4),
                "auto": AutoDrafter(costs=COSTS), "none": None}  # fmt: skip
    return SpeculativeEngine(target, tokenizer, config=EngineConfig(max_batch_size=batch, max_len=128, k=k), drafters=drafters)


DRAFTERS = ["small", "ngram", "suffix", "auto", "prediction", "none"]


def hf_greedy_processed(model, prompt, max_new, params):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=0,
                         logits_processor=hf_processors(params, len(prompt)))  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def engines(tiny_target, tiny_draft, tokenizer):
    return every_drafter_engine(tiny_target, tiny_draft, tokenizer), SpeculativeEngine(
        tiny_target, tokenizer, config=EngineConfig(max_batch_size=4, max_len=128, k=0))


@pytest.mark.integration
@pytest.mark.parametrize("name", [n for n in PROCESSORS if n != "min_p"])  # min_p never moves a greedy token
def test_greedy_output_with_processors_is_the_processed_targets_for_every_drafter(tiny_target, engines, name):
    """Rows with the processor beside rows without it: each row equals the target alone with the
    same settings, and transformers' greedy generate with its own processors."""
    engine, alone = engines
    params = SamplingParams(**PROCESSORS[name], logprobs=2)
    prompts = ragged_prompts(12, seed=71)
    reference = {}
    requests = []
    for i, prompt in enumerate(prompts):
        p = params if i % 2 == 0 else SamplingParams()
        drafter = DRAFTERS[(i // 2) % len(DRAFTERS)]
        [ref] = alone.generate([Request(prompt, p, max_new_tokens=16)])
        reference[i] = ref
        prediction = ref.token_ids if drafter == "prediction" else None
        requests.append(Request(prompt, p, max_new_tokens=16, drafter=drafter, prediction=prediction))
    outs = engine.generate(requests)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.token_ids == reference[i].token_ids, (i, requests[i].drafter)
        if i % 2 == 0:
            assert out.token_ids == hf_greedy_processed(tiny_target, prompt, 16, params)
            assert out.stats["processors"] == list(params.processors)
            # logprobs: the target-alone path's, to 1e-5, one per token
            assert [lp.token_id for lp in out.logprobs] == out.token_ids
            for a, b in zip(out.logprobs, reference[i].logprobs):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
                assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 2
        else:
            assert out.logprobs is None and out.stats["processors"] == []
    assert any(o.stats["drafted"] for o in outs)


@pytest.mark.integration
def test_a_processor_changes_greedy_output(engines, tiny_target):
    """The settings above move tokens (else the identity tests would prove nothing)."""
    _, alone = engines
    prompts = ragged_prompts(4, seed=72)
    plain = [o.token_ids for o in alone.generate([Request(p, max_new_tokens=16) for p in prompts])]
    for name in ("logit_bias", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        outs = alone.generate([Request(p, SamplingParams(**PROCESSORS[name]), max_new_tokens=16) for p in prompts])
        assert [o.token_ids for o in outs] != plain, name


@pytest.mark.integration
def test_seeded_output_with_processors_is_the_same_alone_and_batched(engines):
    engine, _ = engines
    prompts = ragged_prompts(8, seed=73)
    params = SamplingParams(temperature=1.0, seed=11, **PROCESSORS["all"], logprobs=1)
    requests = [Request(p, params if i % 2 == 0 else SamplingParams(temperature=0.8, seed=i), max_new_tokens=14,
                        drafter=DRAFTERS[i % 5]) for i, p in enumerate(prompts)]  # fmt: skip
    solo = [engine.generate([r])[0] for r in requests]
    batched = engine.generate(requests)
    assert [o.token_ids for o in batched] == [o.token_ids for o in solo]
    for a, b in zip(batched, solo):
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs is not None:
            assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-5)


@pytest.mark.integration
def test_logprobs_include_the_first_token_and_an_eos_that_ends_the_request(tiny_target, tokenizer):
    engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=2, max_len=64, k=3),
                               drafters={"ngram": NgramDrafter()})  # fmt: skip
    prompt = ragged_prompts(1, seed=74)[0]
    [free] = engine.generate([Request(prompt, max_new_tokens=10)])
    eos = free.token_ids[3]
    engine.state.eos_ids = torch.tensor([eos])
    engine._eos = {eos}
    [out] = engine.generate([Request(prompt, SamplingParams(logprobs=0), max_new_tokens=10)])
    assert out.token_ids[-1] == eos and len(out.logprobs) == len(out.token_ids) == 4
    assert all(lp.top == () and lp.logprob <= 0 for lp in out.logprobs)


# ---- tier 4: sampled output follows the processed target ---------------------------------------

V5, M, N = 5, 3, 30_000


def processed_distribution(p_table, start, params):
    """P(x_1..x_M | prefix [0, start]) under the target with the processors and the sampling
    transform, by enumeration (the processors of each position see the tokens before it)."""
    probs = {}
    for seq in itertools.product(range(V5), repeat=M):
        prob, history = 1.0, []
        for x in seq:
            cur = history[-1] if history else start
            rows = rows_for([params], [([0], [start] + history)], V5)
            logits = process(p_table[cur].view(1, 1, V5), rows)
            prob *= probs_from_logits(logits, SamplingTensors.build([params], "cpu"))[0, 0, x].item()
            history.append(x)
        probs[seq] = prob
    return probs


def processed_samples(p_table, q_table, params, K, seed):
    """N sequences of M tokens after [0, 1], through ``speculative_step`` with the engine's processor
    state (``Processors``: started per row, committed after each step) and per-row uniforms."""
    target, draft = MarkovStub(p_table), MarkovStub(q_table)
    state = state_for([[0, 1]] * N, capacity=2 + M + K + 8, limit=M + K + 4, eos=[])
    processors = Processors(N, V5, torch.device("cpu"))
    for b in range(N):
        processors.start(b, params, [0], 1)  # the prompt [0], then token 1 as the first generated one
    # The chain's start token 1 counts as generated: the exact distribution counts it too.
    sampling = SamplingTensors.build([params] * N, "cpu", processors.rows(N, [params] * N))
    generators = [torch.Generator().manual_seed(seed * N + i) for i in range(N)]
    while int(state.lengths.min()) < 2 + M:
        before = state.lengths.clone()
        rand = step_uniforms(generators, [K] * N, K, "cpu")
        _, n_new, k = speculative_step(target, draft, state, sampling, rand, K)
        processors.commit(state.tokens.gather(1, before.unsqueeze(1) + torch.arange(k + 1)), n_new)
    return state.tokens[:, 2 : 2 + M]


def chi_square_p(samples, probs):
    from scipy.stats import chisquare

    keys = list(probs)
    codes = (samples * V5 ** torch.arange(M - 1, -1, -1)).sum(1)
    counts = torch.bincount(codes, minlength=len(keys)).float()
    expected = torch.tensor([probs[k] for k in keys]) * N
    small = expected < 5
    obs, exp = torch.cat([counts[~small], counts[small].sum().view(1)]), torch.cat([expected[~small], expected[small].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert obs.sum() == N  # nothing outside the support (a banned token never sampled)
    return chisquare(obs.numpy(), exp.numpy() * (N / exp.sum().item())).pvalue


def markov_tables(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V5, V5, generator=g) * 1.5, torch.randn(V5, V5, generator=g) * 1.5


CHI_SETTINGS = {
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=0.6),
    "bias+min_p": SamplingParams(temperature=0.9, logit_bias=((2, 1.5), (4, -100.0)), min_p=0.08),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHI_SETTINGS))
def test_sampled_output_follows_the_processed_target(name):
    params, K = CHI_SETTINGS[name], 3
    p_table, q_table = markov_tables(21)
    samples = processed_samples(p_table, q_table, params, K, seed=8)
    assert chi_square_p(samples, processed_distribution(p_table, 1, params)) > 1e-3


@pytest.mark.slow
def test_chi_square_catches_penalties_that_ignore_the_drafts_before_a_position(monkeypatch):
    import serving.engine.processors as processors

    real = processors.process
    monkeypatch.setattr(speculative, "process", lambda logits, rows, drafts=None, n_draft=None: real(logits, rows))
    params = CHI_SETTINGS["penalties"]
    p_table, q_table = markov_tables(21)
    samples = processed_samples(p_table, q_table, params, 3, seed=6)
    assert chi_square_p(samples, processed_distribution(p_table, 1, params)) < 1e-6


@pytest.mark.slow
def test_chi_square_catches_a_bonus_drawn_from_the_unprocessed_p(monkeypatch):
    real = speculative.process

    def unprocessed_bonus(logits, rows, drafts=None, n_draft=None):
        return torch.cat([real(logits, rows, drafts, n_draft)[:, :-1], logits[:, -1:]], 1)

    monkeypatch.setattr(speculative, "process", unprocessed_bonus)
    params = CHI_SETTINGS["penalties"]
    p_table, q_table = markov_tables(21)
    samples = processed_samples(p_table, q_table, params, 2, seed=7)
    assert chi_square_p(samples, processed_distribution(p_table, 1, params)) < 1e-6


@pytest.mark.slow
def test_chi_square_catches_an_accept_test_whose_q_did_not_draw_the_token(monkeypatch):
    """The accept test divides by the processed target's p where the draft's q drew the token."""
    real = speculative.accept_reject
    monkeypatch.setattr(speculative, "accept_reject",
                        lambda p, q, tokens, *args: real(p, p[:, : q.shape[1]], tokens, *args))  # fmt: skip
    params = CHI_SETTINGS["bias+min_p"]
    p_table, q_table = markov_tables(21)
    samples = processed_samples(p_table, q_table, params, 2, seed=9)
    assert chi_square_p(samples, processed_distribution(p_table, 1, params)) < 1e-6


@pytest.mark.integration
def test_threshold_rows_never_accept_a_token_the_processors_ban(tiny_target, tokenizer):
    """Threshold verification reads the processed p: a draft of a token that logit_bias bans
    (-100) is never accepted, however low the threshold."""
    from serving.engine.drafters.base import HostDrafter

    class Banned(HostDrafter):
        def propose(self, row, tokens, k):
            return [13] * k

    engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=2, max_len=64, k=3),
                               drafters={"banned": Banned()})  # fmt: skip
    params = SamplingParams(verification="threshold", verification_threshold=1e-9, logit_bias=((13, -100.0),))
    outs = engine.generate([Request(p, params, max_new_tokens=12, drafter="banned") for p in ragged_prompts(2, seed=75)])
    for out in outs:
        assert 13 not in out.token_ids and out.stats["accepted"] == 0 and out.stats["drafted"] > 0


@pytest.mark.integration
def test_a_row_that_falls_back_to_the_target_alone_keeps_its_processors(engines, tiny_target, tokenizer):
    """A fallback stops the row's drafter, not its processors: the rest of its answer is still the
    processed target's."""
    from serving.engine.drafters.base import HostDrafter
    from serving.engine.request import Fallback

    class Wrong(HostDrafter):
        def propose(self, row, tokens, k):
            return [(tokens[-1] + 1) % 300 + 3] * k

    _, alone = engines
    engine = SpeculativeEngine(tiny_target, tokenizer, config=EngineConfig(max_batch_size=2, max_len=128, k=3),
                               drafters={"wrong": Wrong()})  # fmt: skip
    params = SamplingParams(**PROCESSORS["all"])
    for prompt in ragged_prompts(2, seed=76):
        [want] = alone.generate([Request(prompt, params, max_new_tokens=24)])
        [out] = engine.generate([Request(prompt, params, max_new_tokens=24, drafter="wrong",
                                         fallback=Fallback(min_acceptance=0.5, after_drafted=3))])  # fmt: skip
        assert out.stats["fallback"]["at_token"] < 12 and out.token_ids == want.token_ids
