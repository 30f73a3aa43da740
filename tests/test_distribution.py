"""Tier 4: sampled speculative output follows the target's distribution (Leviathan et al. 2023,
Theorem 1), checked with a chi-square test on Markov-chain stubs; and the test has power: it
fails an acceptor that resamples from p instead of the residual max(0, p - q)."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

import serving.speculative as speculative
from serving.acceptance import accept_reject
from serving.sampling import SamplingParams, SamplingTensors, probs_from_logits, sample
from serving.speculative import StepRandom, speculative_step
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


def speculative_samples(p_table, q_table, params, K, seed, device="cpu"):
    target, draft = MarkovStub(p_table.to(device)), MarkovStub(q_table.to(device))
    state = state_for([[0, 1]] * N, capacity=2 + M + K + 8, limit=M + K + 4, eos=[], device=device)
    sampling = SamplingTensors.build([params] * N, device)
    g = torch.Generator(device=device).manual_seed(seed)
    while int(state.lengths.min()) < 2 + M:
        u = torch.rand(N, 2 * K + 1, generator=g, device=device)
        speculative_step(target, draft, state, sampling, StepRandom(u[:, :K], u[:, K : 2 * K], u[:, 2 * K]), K)
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


@pytest.mark.parametrize("K, params", SETTINGS)
def test_sampled_output_follows_target_distribution(K, params):
    p_table, q_table = tables(K)
    samples = speculative_samples(p_table, q_table, params, K, seed=100 + K)
    assert p_value(samples, exact_distribution(p_table, 1, params)) > 1e-3


def wrong_acceptor(p, q, draft_tokens, u_accept, u_next):
    """The classic bug: on rejection, draw from p instead of the residual max(0, p - q)."""
    n, _ = accept_reject(p, q, draft_tokens, u_accept, u_next)
    at = n.view(-1, 1, 1).expand(-1, 1, p.shape[-1])
    return n, sample(p.gather(1, at).squeeze(1), u_next)


def test_chi_square_catches_a_wrong_acceptor(monkeypatch):
    monkeypatch.setattr(speculative, "accept_reject", wrong_acceptor)
    K, params = 2, SamplingParams(temperature=1.0)
    p_table, q_table = tables(K)
    samples = speculative_samples(p_table, q_table, params, K, seed=7)
    assert p_value(samples, exact_distribution(p_table, 1, params)) < 1e-6
