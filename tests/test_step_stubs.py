"""Tier 2: ``speculative_step`` with stub models of fixed logits (accept all, reject all, reject
at each position), plus EOS and length limits inside an accepted block."""

import pytest
import torch

from serving.engine.sampling import SamplingParams, SamplingTensors
from serving.engine.speculative import StepRandom, speculative_step
from tests.stubs import PositionStub, state_for

pytestmark = pytest.mark.integration

V = 50


def target_script(t):  # the target's greedy continuation at absolute position t
    return (7 * t + 3) % V


def greedy(B):
    return SamplingTensors.build([SamplingParams()] * B, "cpu")


def rand(B, K):
    return StepRandom(torch.rand(B, K), torch.rand(B, K), torch.rand(B))


def run(draft_script, K, prefix_len=6, limit=100, eos=None):
    target, draft = PositionStub(V, target_script), PositionStub(V, draft_script)
    prefix = [target_script(t) for t in range(prefix_len)]
    state = state_for([prefix], capacity=64, limit=limit, eos=eos or [])
    n_acc, n_new, _ = speculative_step(target, draft, state, greedy(1), rand(1, K), K)
    new = state.tokens[0, prefix_len : prefix_len + int(n_new)].tolist()
    return int(n_acc), int(n_new), new, state, target, draft


@pytest.mark.parametrize("K", [1, 3, 5])
def test_accept_all_commits_k_plus_bonus(K):
    n_acc, n_new, new, state, target, draft = run(target_script, K)
    assert (n_acc, n_new) == (K, K + 1)
    assert new == [target_script(6 + i) for i in range(K + 1)]
    assert target.calls == [K + 1]  # one verification over K+1 tokens
    assert draft.calls == [2] + [1] * (K - 1)  # catch-up pair, then one token at a time


@pytest.mark.parametrize("K", [1, 4])
def test_reject_all_commits_the_targets_token(K):
    n_acc, n_new, new, *_ = run(lambda t: (target_script(t) + 1) % V, K)
    assert (n_acc, n_new, new) == (0, 1, [target_script(6)])


@pytest.mark.parametrize("j", range(4))
def test_reject_at_each_position(j):
    K = 4
    wrong_at = 6 + j  # the draft's j-th token (absolute position 6 + j) is wrong
    draft = lambda t: (target_script(t) + 1) % V if t == wrong_at else target_script(t)  # noqa: E731
    n_acc, n_new, new, *_ = run(draft, K)
    assert (n_acc, n_new) == (j, j + 1)
    assert new == [target_script(6 + i) for i in range(j + 1)]


def test_eos_inside_accepted_block_stops_the_row():
    eos = target_script(8)  # the third new token
    n_acc, n_new, new, state, *_ = run(target_script, 4, eos=[eos])
    assert n_acc == 4 and n_new == 3 and new[-1] == eos
    assert bool(state.done[0]) and int(state.lengths[0]) == 9


def test_length_limit_cuts_the_block():
    n_acc, n_new, new, state, *_ = run(target_script, 4, limit=2)
    assert n_new == 2 and bool(state.done[0])


def test_done_rows_are_frozen():
    target, draft = PositionStub(V, target_script), PositionStub(V, target_script)
    state = state_for([[1, 2, 3], [4, 5, 6, 7]], capacity=32, limit=20, eos=[])
    state.done[1] = True
    before = state.tokens[1].clone()
    _, n_new, _ = speculative_step(target, draft, state, greedy(2), rand(2, 3), 3)
    assert n_new.tolist() == [4, 0] and state.lengths.tolist() == [7, 4]
    assert torch.equal(state.tokens[1], before)


def test_no_draft_is_target_only():
    target = PositionStub(V, target_script)
    state = state_for([[1, 2, 3]], capacity=16, limit=10, eos=[])
    n_acc, n_new, _ = speculative_step(target, None, state, greedy(1), rand(1, 0), 0)
    assert (int(n_acc), int(n_new)) == (0, 1) and target.calls == [1]


def test_draft_confidence_stops_drafting_early():
    # The draft's logits are one-hot * 10 over 50 tokens: top probability ~0.998, so a threshold
    # above that stops after the first token and the target verifies a 2-token block.
    target, draft = PositionStub(V, target_script), PositionStub(V, target_script)
    state = state_for([[target_script(t) for t in range(6)]], capacity=64, limit=100, eos=[])
    n_acc, n_new, k = speculative_step(target, draft, state, greedy(1), rand(1, 4), 4, draft_confidence=0.999)
    assert (k, int(n_acc), int(n_new)) == (1, 1, 2) and draft.calls == [2] and target.calls == [2]
    # Below the draft's confidence nothing changes.
    target, draft = PositionStub(V, target_script), PositionStub(V, target_script)
    state = state_for([[target_script(t) for t in range(6)]], capacity=64, limit=100, eos=[])
    assert speculative_step(target, draft, state, greedy(1), rand(1, 4), 4, draft_confidence=0.5)[2] == 4


def test_cumulative_draft_stop_multiplies_the_confidences():
    # Top probability 0.99778 per token: its running product falls below 0.996 at the second
    # token (0.99557), while each token alone stays above it.
    for stop, drafted in (("token", 4), ("cumulative", 2)):
        target, draft = PositionStub(V, target_script), PositionStub(V, target_script)
        state = state_for([[target_script(t) for t in range(6)]], capacity=64, limit=100, eos=[])
        k = speculative_step(target, draft, state, greedy(1), rand(1, 4), 4, draft_confidence=0.996, draft_stop=stop)[2]
        assert k == drafted and target.calls == [drafted + 1]


def test_unknown_draft_stop_is_a_clear_error():
    from serving.engine import EngineConfig

    with pytest.raises(ValueError, match="draft_stop='product' must be 'token' or 'cumulative'"):
        EngineConfig(draft_stop="product")
