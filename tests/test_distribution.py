"""Tier 4: sampled speculative output follows the target's distribution (Leviathan et al. 2023,
Theorem 1), checked with a chi-square test on the joint distribution of three tokens from
Markov-chain stubs, drawn with the engine's own per-row uniforms (``step_uniforms``), with and
without early drafting stops and per-row K. The test has power: it fails an acceptor that
resamples from p instead of the residual max(0, p - q), accept tests that reuse the draft's
uniforms, and a drafting stop that drops an unlikely drawn token. Model-free proposals (point
masses, q = one-hot) are checked the same way, with the same power check."""

import itertools
import sys

import pytest
import torch
from scipy.stats import chisquare

import serving.engine.core as engine
import serving.engine.speculative as speculative
from serving.engine.acceptance import accept_reject
from serving.engine.speculative import step_uniforms
from serving.engine.sampling import SamplingParams, SamplingTensors, probs_from_logits, sample
from serving.engine.speculative import StepRandom, speculative_step
from tests.stubs import MarkovStub, state_for

pytestmark = pytest.mark.integration

V, M, N = 5, 3, 40_000  # vocabulary, tokens per sample, samples


def tables(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * 1.5, torch.randn(V, V, generator=g) * 1.5


def exact_distribution(p_table, start, params):
    """P(x_1..x_M | start) under the target with the sampling transform applied."""
    s = SamplingTensors.build([params] * V, "cpu")
    step = probs_from_logits(p_table.unsqueeze(1), s)[:, 0]  # [V, V]: row = current token
    probs = {}
    for seq in itertools.product(range(V), repeat=M):
        prob, cur = 1.0, start
        for x in seq:
            prob, cur = prob * step[cur, x].item(), x
        probs[seq] = prob
    return probs


def sharp_draft_table():
    """A draft that is confident after some tokens and unsure after others (top probability 0.3
    to 0.8), so stops that look at the draft's confidence fire on some contexts and not others."""
    probs = torch.tensor([
        [0.10, 0.20, 0.30, 0.20, 0.20],
        [0.70, 0.05, 0.15, 0.05, 0.05],
        [0.05, 0.05, 0.05, 0.80, 0.05],
        [0.25, 0.25, 0.20, 0.15, 0.15],
        [0.10, 0.65, 0.10, 0.10, 0.05],
    ])  # fmt: skip
    return probs.log()


def speculative_samples(p_table, q_table, params, K, seed, device="cpu", draft_confidence=None, draft_stop="token",
                        mixed_k=False):  # fmt: skip
    """N sequences of M tokens after the prefix [0, 1], decoded by ``speculative_step`` with the
    engine's own uniforms (``step_uniforms``: per-row seeded generators). ``mixed_k``: every row
    has its own K in 1..K (padded, masked slots), as requests with their own K share a step."""
    target, draft = MarkovStub(p_table.to(device)), MarkovStub(q_table.to(device))
    state = state_for([[0, 1]] * N, capacity=2 + M + K + 8, limit=M + K + 4, eos=[], device=device)
    sampling = SamplingTensors.build([params] * N, device)
    generators = [torch.Generator().manual_seed(seed * N + i) for i in range(N)]
    k_rows = [1 + i % K for i in range(N)] if mixed_k else [K] * N
    budget = torch.tensor(k_rows, device=device)
    while int(state.lengths.min()) < 2 + M:
        rand = step_uniforms(generators, k_rows, K, device)
        speculative_step(target, draft, state, sampling, rand, K, draft_confidence=draft_confidence,
                         draft_stop=draft_stop, k_rows=budget)  # fmt: skip
    return state.tokens[:, 2 : 2 + M].cpu()


def p_value(samples, probs):
    keys = list(probs)  # itertools.product order = base-V numbering of the sequence
    codes = (samples * V ** torch.arange(M - 1, -1, -1)).sum(1)
    counts = torch.bincount(codes, minlength=len(keys)).float()
    expected = torch.tensor([probs[k] for k in keys]) * N
    # Pool cells expected below 5 into one, as the chi-square approximation needs.
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert obs.sum() == N  # no sample fell outside the support (zero-probability sequences)
    return chisquare(obs.numpy(), exp.numpy() * (N / exp.sum().item())).pvalue


SETTINGS = [
    (1, SamplingParams(temperature=1.0)),
    (2, SamplingParams(temperature=0.7, top_k=3)),
    (3, SamplingParams(temperature=1.2, top_p=0.8)),
    (4, SamplingParams(temperature=0.9, top_k=4, top_p=0.9)),
]


def fast_one(cases, keep: int, ids=None):
    """All cases for CI; only ``cases[keep]`` (the most general) in the developers' fast tier."""
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=() if i == keep else pytest.mark.slow,
                         id=ids[i] if ids else None) for i, c in enumerate(cases)]  # fmt: skip


@pytest.mark.parametrize("K, params", fast_one(SETTINGS, keep=3))
def test_sampled_output_follows_target_distribution(K, params):
    p_table, q_table = tables(K)
    samples = speculative_samples(p_table, q_table, params, K, seed=100 + K)
    assert p_value(samples, exact_distribution(p_table, 1, params)) > 1e-3


# The early drafting stops and per-row K, on a draft whose confidence depends on the context.
STOPS = [
    dict(draft_confidence=0.6, draft_stop="token"),
    dict(draft_confidence=0.5, draft_stop="cumulative"),
    dict(mixed_k=True),
    dict(mixed_k=True, draft_confidence=0.6),
]


@pytest.mark.parametrize("stop", fast_one(STOPS, keep=3, ids=["token-stop", "cumulative-stop", "mixed-k", "mixed-k-token-stop"]))
def test_early_stops_and_per_row_k_keep_the_target_distribution(stop):
    p_table, _ = tables(3)
    params = SamplingParams(temperature=1.0)
    samples = speculative_samples(p_table, sharp_draft_table(), params, 3, seed=300, **stop)
    assert p_value(samples, exact_distribution(p_table, 1, params)) > 1e-3


def point_mass_samples(p_table, params, K, seed, device="cpu"):
    """As ``speculative_samples``, with a model-free drafter (``ngram``, ``suffix``, ``prediction``):
    each row proposes K tokens that depend on its context (here: counting up from its last token,
    so some proposals are likely and some are not), as point masses, q = one-hot."""
    target = MarkovStub(p_table.to(device))
    state = state_for([[0, 1]] * N, capacity=2 + M + K + 8, limit=M + K + 4, eos=[], device=device)
    sampling = SamplingTensors.build([params] * N, device)
    generators = [torch.Generator().manual_seed(seed * N + i) for i in range(N)]
    k_rows = [1 + i % K for i in range(N)]  # per-row budgets, padded to K
    n_draft = torch.tensor(k_rows, device=device)
    while int(state.lengths.min()) < 2 + M:
        rand = step_uniforms(generators, k_rows, K, device)
        last = state.tokens.gather(1, (state.lengths - 1).unsqueeze(1))  # [N, 1]
        proposal = (last + 1 + torch.arange(K, device=device)) % V  # [N, K]
        q = torch.nn.functional.one_hot(proposal, V).float()  # [N, K, V]
        speculative.verify_half(target, state, sampling, rand, proposal, q, n_draft=n_draft)
    return state.tokens[:, 2 : 2 + M].cpu()


@pytest.mark.parametrize("K, params", fast_one(SETTINGS[:3], keep=2))
def test_point_mass_proposals_keep_the_target_distribution(K, params):
    p_table, _ = tables(10 + K)
    samples = point_mass_samples(p_table, params, K, seed=500 + K)
    assert p_value(samples, exact_distribution(p_table, 1, params)) > 1e-3


# ---- power: each known-bad change must fail the statistic ------------------------------------


def wrong_acceptor(p, q, draft_tokens, u_accept, u_next, n_draft=None, lossy_accept=None):
    """The classic bug: on rejection, draw from p instead of the residual max(0, p - q)."""
    n, _ = accept_reject(p, q, draft_tokens, u_accept, u_next, n_draft, lossy_accept)
    at = n.view(-1, 1, 1).expand(-1, 1, p.shape[-1])
    return n, sample(p.gather(1, at).squeeze(1), u_next)


def reused_uniforms(generators, k_rows, k, device):
    """Accept tests that reuse the uniforms that drew the draft tokens."""
    rand = engine.step_uniforms(generators, k_rows, k, device)
    return StepRandom(draft=rand.draft, accept=rand.draft.clone(), next=rand.next)


@pytest.mark.slow  # the test's power against a known-bad acceptor: rarely changes
def test_chi_square_catches_a_wrong_acceptor(monkeypatch):
    monkeypatch.setattr(speculative, "accept_reject", wrong_acceptor)
    K, params = 2, SamplingParams(temperature=1.0)
    p_table, q_table = tables(K)
    samples = speculative_samples(p_table, q_table, params, K, seed=7)
    assert p_value(samples, exact_distribution(p_table, 1, params)) < 1e-6


@pytest.mark.slow  # the test's power against a known-bad acceptor: rarely changes
def test_chi_square_catches_accept_tests_that_reuse_the_draft_uniforms(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "step_uniforms", reused_uniforms)
    K, params = 3, SamplingParams(temperature=1.0)
    p_table, q_table = tables(K)
    samples = speculative_samples(p_table, q_table, params, K, seed=8)
    assert p_value(samples, exact_distribution(p_table, 1, params)) < 1e-6


@pytest.mark.slow  # the test's power against a known-bad acceptor: rarely changes
def test_chi_square_catches_a_stop_that_drops_an_unlikely_draft_token(monkeypatch):
    """A drafting stop that looks at the drawn token (drop it, and stop, when the draft gave it
    less than 0.3) makes the proposal a truncated q while the accept rule still divides by q."""
    real_sample = speculative.sample

    def dropping_sample(probs, u):
        x = real_sample(probs, u)
        unlikely = probs.gather(-1, x.unsqueeze(-1)).squeeze(-1) < 0.3
        return torch.where(unlikely, -1, x)  # a token id no row can hold: the row stops here

    def draft_half_dropping(*args, **kwargs):
        monkeypatch.setattr(speculative, "sample", dropping_sample)
        try:
            tokens, q, n_draft = real_draft_half(*args, **kwargs)
        finally:
            monkeypatch.setattr(speculative, "sample", real_sample)
        dropped = (tokens < 0).long()  # [B, K]
        first = torch.where(dropped.any(1), dropped.argmax(1), tokens.shape[1])  # [B]
        return tokens.clamp(min=0), q, torch.minimum(n_draft, first)

    real_draft_half = speculative.draft_half
    monkeypatch.setattr(speculative, "draft_half", draft_half_dropping)
    p_table, _ = tables(3)
    params = SamplingParams(temperature=1.0)
    samples = speculative_samples(p_table, sharp_draft_table(), params, 3, seed=9)
    assert p_value(samples, exact_distribution(p_table, 1, params)) < 1e-6


@pytest.mark.slow  # the test's power against a known-bad acceptor: rarely changes
def test_chi_square_catches_a_wrong_acceptor_of_point_masses(monkeypatch):
    """With a model-free drafter, resampling a rejected point mass from p (not p without it)."""
    monkeypatch.setattr(speculative, "accept_reject", wrong_acceptor)
    K, params = 2, SamplingParams(temperature=1.0)
    p_table, _ = tables(10 + K)
    samples = point_mass_samples(p_table, params, K, seed=9)
    assert p_value(samples, exact_distribution(p_table, 1, params)) < 1e-6


@pytest.mark.unit
def test_every_mutant_of_the_mutation_check_still_applies():
    """scripts/mutation_check.py's known-bad changes are exact text replacements; a refactor that
    moves their code makes them stale, and a stale mutant checks nothing (one had gone stale
    unnoticed). Each one's text must occur exactly once in its file."""
    from pathlib import Path

    from tests.conftest import load_script

    root = Path(__file__).resolve().parent.parent
    module = load_script("scripts/mutation_check.py")
    assert module.MUTANTS
    stale = [(m.name, (root / m.path).read_text().count(m.old)) for m in module.MUTANTS
             if (root / m.path).read_text().count(m.old) != 1]  # fmt: skip
    assert not stale, f"stale mutants (name, occurrences): {stale}; make each follow its code"
