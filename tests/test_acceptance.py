"""Tier 1: the accept/reject rule and the sampling transform on hand-made tensors."""

import pytest
import torch

from serving.engine.acceptance import accept_reject, threshold_accepts
from serving.engine.sampling import SamplingParams, SamplingTensors, probs_from_logits, sample

pytestmark = pytest.mark.unit


def one_hot(ids, V=5):
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float()


def test_greedy_accepts_matching_prefix_then_corrects():
    # Target argmax per position: 1, 2, 3, bonus 4. Draft proposes 1, 2, 0.
    p = one_hot([[1, 2, 3, 4]])  # [1, 4, V]
    q = one_hot([[1, 2, 0]])  # [1, 3, V]
    n, nxt = accept_reject(p, q, torch.tensor([[1, 2, 0]]), torch.full((1, 3), 0.99), torch.tensor([0.5]))
    assert n.tolist() == [2] and nxt.tolist() == [3]


def test_greedy_all_accepted_gives_bonus_token():
    p = one_hot([[1, 2, 3, 4]])
    q = one_hot([[1, 2, 3]])
    n, nxt = accept_reject(p, q, torch.tensor([[1, 2, 3]]), torch.full((1, 3), 0.999), torch.tensor([0.3]))
    assert n.tolist() == [3] and nxt.tolist() == [4]


def test_rows_accept_independently():
    p = one_hot([[1, 2, 3], [1, 2, 3]])
    q = one_hot([[0, 2], [1, 2]])
    n, nxt = accept_reject(p, q, torch.tensor([[0, 2], [1, 2]]), torch.zeros(2, 2), torch.zeros(2))
    assert n.tolist() == [0, 2] and nxt.tolist() == [1, 3]


def test_acceptance_probability_is_min_one_p_over_q():
    # p(x)=0.2, q(x)=0.5: accepted iff u < 0.4.
    p = torch.tensor([[[0.2, 0.8], [0.5, 0.5]]])
    q = torch.tensor([[[0.5, 0.5]]])
    x = torch.tensor([[0]])
    assert accept_reject(p, q, x, torch.tensor([[0.39]]), torch.tensor([0.0]))[0].item() == 1
    assert accept_reject(p, q, x, torch.tensor([[0.41]]), torch.tensor([0.0]))[0].item() == 0


def test_rejection_draws_from_residual_only():
    # residual = max(0, p - q) = [0, 0.3, 0]: token 1 whatever the uniform.
    p = torch.tensor([[[0.2, 0.5, 0.3], [1 / 3, 1 / 3, 1 / 3]]])
    q = torch.tensor([[[0.5, 0.2, 0.3]]])
    for u in (0.0, 0.5, 0.999):
        n, nxt = accept_reject(p, q, torch.tensor([[0]]), torch.tensor([[0.9]]), torch.tensor([u]))
        assert n.item() == 0 and nxt.item() == 1


def test_k_zero_is_target_only_sampling():
    p = torch.tensor([[[0.1, 0.0, 0.9]]])
    n, nxt = accept_reject(p, torch.zeros(1, 0, 3), torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0), torch.tensor([0.05]))
    assert n.item() == 0 and nxt.item() == 0
    n, nxt = accept_reject(p, torch.zeros(1, 0, 3), torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0), torch.tensor([0.5]))
    assert nxt.item() == 2


def test_sample_is_inverse_cdf_and_skips_zero_mass():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75])
    assert sample(probs, torch.tensor(0.0)).item() == 1
    assert sample(probs, torch.tensor(0.2499)).item() == 1
    assert sample(probs, torch.tensor(0.26)).item() == 3
    assert sample(probs, torch.tensor(0.9999999)).item() == 3


def _sampling(**kw):
    return SamplingTensors.build([SamplingParams(**kw)], "cpu")


def test_greedy_transform_is_one_hot_at_first_argmax():
    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.0]]])
    assert probs_from_logits(logits, _sampling()).tolist() == [[[0.0, 1.0, 0.0, 0.0]]]


def test_top_k_top_p_temperature_match_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )  # fmt: skip

    torch.manual_seed(0)
    logits = torch.randn(1, 3, 50)
    for t, k, p in [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.6, 10, 0.9)]:
        ours = probs_from_logits(logits, _sampling(temperature=t, top_k=k, top_p=p))
        ref = logits[0] / t
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        torch.testing.assert_close(ours[0], ref.softmax(-1), atol=1e-6, rtol=1e-5)


def test_mixed_batch_rows_use_their_own_settings():
    logits = torch.tensor([[[0.0, 1.0, 2.0]], [[0.0, 1.0, 2.0]]])
    s = SamplingTensors.build([SamplingParams(), SamplingParams(temperature=1.0, top_k=2)], "cpu")
    probs = probs_from_logits(logits, s)
    assert probs[0, 0].tolist() == [0.0, 0.0, 1.0]
    assert probs[1, 0, 0] == 0 and abs(probs[1, 0, 2] / probs[1, 0, 1] - torch.e) < 1e-4


@pytest.mark.parametrize(
    "kw, field", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k")]
)
def test_bad_sampling_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


# ---- threshold verification (opt-in, lossy) ------------------------------------------------------


def test_threshold_accepts_only_lossy_rows_at_or_above_their_threshold():
    p_plain = torch.tensor([[[0.5, 0.3, 0.2], [0.05, 0.9, 0.05]]]).expand(2, 2, 3)  # [B=2, K=2, V=3]
    drafts = torch.tensor([[1, 0], [1, 0]])  # p(x) = 0.3 then 0.05 in both rows
    extra = threshold_accepts(p_plain, drafts, torch.tensor([0.0, 0.3]))  # row 0 exact, row 1 at 0.3
    assert extra.tolist() == [[False, False], [True, False]]  # 0.3 >= 0.3 passes, 0.05 does not


def test_threshold_acceptance_replaces_the_first_unaccepted_draft_as_exact_does():
    # Greedy: the target's argmax is 1, 2, 3, bonus 4; the draft proposes 0, 2, 0.
    p, q, drafts = one_hot([[1, 2, 3, 4]]), one_hot([[0, 2, 0]]), torch.tensor([[0, 2, 0]])
    u, u_next = torch.full((1, 3), 0.5), torch.tensor([0.5])
    assert accept_reject(p, q, drafts, u, u_next)[0].tolist() == [0]  # exact: the first draft is wrong
    lossy = torch.tensor([[True, False, False]])  # the threshold rule accepts the first one only
    n, nxt = accept_reject(p, q, drafts, u, u_next, lossy_accept=lossy)
    assert n.tolist() == [2] and nxt.tolist() == [3]  # draft 2 is the argmax; draft 3 is corrected to 3


def test_an_exact_row_beside_threshold_rows_gets_no_threshold():
    params = [SamplingParams(verification_threshold=0.01), SamplingParams(verification="threshold", verification_threshold=0.2)]
    s = SamplingTensors.build(params, "cpu")
    assert s.lossy and s.threshold.tolist() == [0.0, pytest.approx(0.2)]
    assert not SamplingTensors.build(params[:1], "cpu").lossy and SamplingTensors.build(params[:1], "cpu").threshold is None


@pytest.mark.parametrize("kw, field", [({"verification": "fast"}, "verification"),
                                       ({"verification_threshold": 0.0}, "verification_threshold"),
                                       ({"verification_threshold": 1.5}, "verification_threshold")])  # fmt: skip
def test_bad_verification_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)
