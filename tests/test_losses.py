"""Distillation losses: hand-computed values on V=3, masking, gradients, temperature and errors."""

import math

import pytest
import torch

from training.losses import (
    DIVERGENCES,
    DistillLoss,
    cross_entropy,
    forward_kl,
    generalized_jsd,
    masked_mean,
    reverse_kl,
    total_variation,
)

pytestmark = pytest.mark.unit

P = [0.7, 0.2, 0.1]  # teacher
Q = [0.4, 0.4, 0.2]  # student


def logits(probs: list[float]) -> torch.Tensor:
    """[1, 1, V] logits whose softmax is ``probs`` (log-probabilities are valid logits)."""
    return torch.tensor(probs).log().view(1, 1, -1)


def kl(a: list[float], b: list[float]) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a, b))


ONE = torch.ones(1, 1, dtype=torch.bool)


def all_losses(s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> dict:
    out = {name: fn(s, t, mask, temperature=temperature) for name, fn in DIVERGENCES.items()}
    out["jsd_0.2"] = generalized_jsd(s, t, mask, beta=0.2, temperature=temperature)
    return out


def test_forward_kl_by_hand():
    expected = 0.7 * math.log(0.7 / 0.4) + 0.2 * math.log(0.2 / 0.4) + 0.1 * math.log(0.1 / 0.2)
    assert expected == pytest.approx(0.183787, abs=1e-6)
    assert forward_kl(logits(Q), logits(P), ONE).item() == pytest.approx(expected, rel=1e-5)


def test_reverse_kl_by_hand():
    expected = 0.4 * math.log(0.4 / 0.7) + 0.4 * math.log(0.4 / 0.2) + 0.2 * math.log(0.2 / 0.1)
    assert reverse_kl(logits(Q), logits(P), ONE).item() == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(kl(P, Q))  # the two directions really differ here


@pytest.mark.parametrize("beta", [0.5, 0.2, 0.9])
def test_generalized_jsd_by_hand(beta):
    m = [beta * p + (1 - beta) * q for p, q in zip(P, Q)]
    expected = beta * kl(P, m) + (1 - beta) * kl(Q, m)
    assert generalized_jsd(logits(Q), logits(P), ONE, beta=beta).item() == pytest.approx(expected, rel=1e-5)


def test_symmetric_jsd_is_symmetric_and_bounded_by_log2():
    a = generalized_jsd(logits(Q), logits(P), ONE, beta=0.5)
    b = generalized_jsd(logits(P), logits(Q), ONE, beta=0.5)
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    far = generalized_jsd(torch.tensor([[[30.0, 0, 0]]]), torch.tensor([[[0, 30.0, 0]]]), ONE, beta=0.5)
    assert far.item() == pytest.approx(math.log(2), rel=1e-4)


def test_jsd_endpoints_are_forward_and_reverse_kl():
    s, t = logits(Q), logits(P)
    assert generalized_jsd(s, t, ONE, beta=0.0).item() == pytest.approx(forward_kl(s, t, ONE).item())
    assert generalized_jsd(s, t, ONE, beta=1.0).item() == pytest.approx(reverse_kl(s, t, ONE).item())
    # Near the endpoints, JSD / beta -> forward KL and JSD / (1 - beta) -> reverse KL.
    eps = 1e-3
    assert (generalized_jsd(s, t, ONE, beta=eps) / eps).item() == pytest.approx(kl(P, Q), rel=1e-2)
    assert (generalized_jsd(s, t, ONE, beta=1 - eps) / eps).item() == pytest.approx(kl(Q, P), rel=1e-2)


def test_total_variation_by_hand():
    assert total_variation(logits(Q), logits(P), ONE).item() == pytest.approx(0.3, rel=1e-5)


def test_cross_entropy_by_hand_and_ignore_index():
    s = torch.cat([logits(Q), logits(P)], dim=1)  # [1, 2, 3]
    assert cross_entropy(s, torch.tensor([[0, 2]])).item() == pytest.approx(-(math.log(0.4) + math.log(0.1)) / 2, rel=1e-5)
    assert cross_entropy(s, torch.tensor([[0, -100]])).item() == pytest.approx(-math.log(0.4), rel=1e-5)
    assert cross_entropy(s, torch.full((1, 2), -100)).item() == 0.0


def test_zero_when_student_equals_teacher():
    x = torch.randn(2, 5, 11)
    mask = torch.ones(2, 5, dtype=torch.bool)
    for name, value in all_losses(x, x.clone(), mask, temperature=1.7).items():
        assert value.item() == pytest.approx(0.0, abs=1e-6), name


def test_padding_changes_nothing():
    torch.manual_seed(0)
    s, t = torch.randn(1, 3, 7), torch.randn(1, 3, 7)
    mask = torch.ones(1, 3, dtype=torch.bool)
    # Pad each sequence to length 5 and add a fully padded row, all with arbitrary logits.
    s_pad, t_pad = torch.randn(2, 5, 7) * 50, torch.randn(2, 5, 7) * 50
    s_pad[0, :3], t_pad[0, :3] = s[0], t[0]
    mask_pad = torch.zeros(2, 5, dtype=torch.bool)
    mask_pad[0, :3] = True
    plain, padded = all_losses(s, t, mask), all_losses(s_pad, t_pad, mask_pad)
    for name in plain:
        assert padded[name].item() == pytest.approx(plain[name].item(), rel=1e-5), name
    labels = torch.tensor([[1, 2, 3]])
    labels_pad = torch.full((2, 5), -100)
    labels_pad[0, :3] = labels[0]
    assert cross_entropy(s_pad, labels_pad).item() == pytest.approx(cross_entropy(s, labels).item(), rel=1e-5)


def test_per_token_mean_weighs_every_token_equally():
    # Sequence 0 has 1 real token, sequence 1 has 3: the loss is the mean of the 4 token values,
    # not the mean of the two per-sequence means.
    torch.manual_seed(1)
    s, t = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    per_token = [forward_kl(s[b : b + 1, i : i + 1], t[b : b + 1, i : i + 1], ONE).item() for b, i in mask.nonzero().tolist()]
    assert forward_kl(s, t, mask).item() == pytest.approx(sum(per_token) / 4, rel=1e-5)
    seq_means = (per_token[0] + sum(per_token[1:]) / 3) / 2
    assert forward_kl(s, t, mask).item() != pytest.approx(seq_means, rel=1e-3)


def test_masked_mean_of_nothing_is_zero():
    assert masked_mean(torch.full((2, 3), float("nan")), torch.zeros(2, 3)).item() == 0.0


def test_gradients_reach_the_student_only():
    torch.manual_seed(2)
    for name in [*DIVERGENCES, "ce"]:
        s = torch.randn(2, 4, 9, requires_grad=True)
        t = torch.randn(2, 4, 9, requires_grad=True)
        if name == "ce":
            loss, _ = DistillLoss("ce")(s, t, torch.randint(0, 9, (2, 4)))
        else:
            loss, _ = DistillLoss(name)(s, t, torch.zeros(2, 4, dtype=torch.long))
        loss.backward()
        assert t.grad is None, name
        assert s.grad is not None and s.grad.abs().sum() > 0 and torch.isfinite(s.grad).all(), name


def test_temperature_scales_kl_by_t_squared_and_leaves_tvd_unscaled():
    torch.manual_seed(3)
    s, t = torch.randn(1, 4, 6), torch.randn(1, 4, 6)
    mask = torch.ones(1, 4, dtype=torch.bool)
    T = 2.0
    for fn in (forward_kl, reverse_kl, generalized_jsd):
        assert fn(s, t, mask, temperature=T).item() == pytest.approx(T**2 * fn(s / T, t / T, mask).item(), rel=1e-5)
    assert total_variation(s, t, mask, temperature=T).item() == pytest.approx(total_variation(s / T, t / T, mask).item(), rel=1e-5)
    # A higher temperature flattens both distributions: the (unscaled) divergence shrinks.
    assert total_variation(s, t, mask, temperature=4.0) < total_variation(s, t, mask)
    with pytest.raises(ValueError, match="temperature"):
        forward_kl(s, t, mask, temperature=0.0)


def test_infinite_logits_stay_finite():
    s = torch.tensor([[[0.0, 1.0, float("-inf")]]], requires_grad=True)
    t = torch.tensor([[[0.5, float("-inf"), float("-inf")]]])
    for name, value in all_losses(s, t, ONE).items():
        value.backward()
        assert torch.isfinite(value) and torch.isfinite(s.grad).all(), name
        s.grad = None


def test_distill_loss_combines_and_reports_parts():
    torch.manual_seed(4)
    s, t = torch.randn(2, 3, 5, requires_grad=True), torch.randn(2, 3, 5)
    labels = torch.tensor([[1, 2, -100], [0, -100, -100]])
    loss, parts = DistillLoss("reverse_kl", ce_ratio=0.25, temperature=1.5)(s, t, labels)
    ce = cross_entropy(s, labels)
    div = reverse_kl(s, t, labels != -100, temperature=1.5)
    assert parts.keys() == {"ce", "divergence"}
    assert parts["ce"].item() == pytest.approx(ce.item())
    assert parts["divergence"].item() == pytest.approx(div.item())
    assert loss.item() == pytest.approx(0.25 * ce.item() + 0.75 * div.item())
    assert loss.requires_grad and not any(v.requires_grad for v in parts.values())
    jsd, _ = DistillLoss("jsd", beta=0.2)(s, t, labels)
    assert jsd.item() == pytest.approx(generalized_jsd(s, t, labels != -100, beta=0.2).item())


def test_explicit_mask_overrides_labels():
    # Labels clamped to valid ids everywhere plus a separate mask give the same loss as -100 labels.
    torch.manual_seed(5)
    s, t = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    labels = torch.tensor([[1, 2, -100], [0, -100, -100]])
    loss_fn = DistillLoss("forward_kl", ce_ratio=0.5)
    expected, _ = loss_fn(s, t, labels)
    got, _ = loss_fn(s, t, labels.clamp(min=0), labels != -100)
    assert got.item() == pytest.approx(expected.item())


def test_ce_kind_and_pure_ce_need_no_teacher():
    s, labels = torch.randn(1, 2, 4), torch.tensor([[1, 3]])
    for loss_fn in (DistillLoss("ce"), DistillLoss("jsd", ce_ratio=1.0)):
        loss, parts = loss_fn(s, None, labels)
        assert parts.keys() == {"ce"} and loss.item() == pytest.approx(cross_entropy(s, labels).item())
    assert DistillLoss("ce", ce_ratio=0.0)(s, torch.randn(1, 2, 4), labels)[0].item() == pytest.approx(cross_entropy(s, labels).item())
    with pytest.raises(ValueError, match="teacher_logits"):
        DistillLoss(ce_ratio=0.5)(s, None, labels)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"'kl'.*ce, forward_kl, reverse_kl, jsd, tvd"):
        DistillLoss("kl")
    with pytest.raises(ValueError, match="ce_ratio"):
        DistillLoss(ce_ratio=1.5)
    with pytest.raises(ValueError, match="beta"):
        DistillLoss("jsd", beta=-0.1)


def test_vocab_width_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"student vocab width 5 != teacher width 7.*slice"):
        forward_kl(torch.randn(1, 2, 5), torch.randn(1, 2, 7), torch.ones(1, 2))
    with pytest.raises(ValueError, match="mask"):
        forward_kl(torch.randn(1, 2, 5), torch.randn(1, 2, 5), torch.ones(2, 2))
