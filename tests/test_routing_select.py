"""Cross-validated model selection (routing.select) on hand-made values: folds partition the
prompts by domain, and the winner is the candidate whose held-out choices score best."""

from __future__ import annotations

import pytest
import torch

from routing.select import cross_validate, folds, grid
from routing.train import domain_means, shrink_to_domain

pytestmark = pytest.mark.unit


def test_grid_is_every_combination_in_order():
    assert grid({"a": [1, 2], "b": [3, 4]}) == [{"a": 1, "b": 3}, {"a": 1, "b": 4}, {"a": 2, "b": 3}, {"a": 2, "b": 4}]
    assert grid({}) == [{}]


def test_folds_partition_stratified_and_deterministic():
    domains = ["code"] * 9 + ["chat"] * 6 + ["math"] * 3
    ids = [f"p{i:02d}" for i in range(18)]
    idx = list(range(1, 18))  # prompt 0 is not a training prompt
    f = folds(domains, ids, idx, 3, seed=0)
    assert sorted(i for fold in f for i in fold) == idx  # a partition of idx
    assert max(map(len, f)) - min(map(len, f)) <= 1
    for d in ("code", "chat", "math"):
        assert all(any(domains[i] == d for i in fold) for fold in f)
    assert f == folds(domains, ids, idx, 3, seed=0)
    assert f != folds(domains, ids, idx, 3, seed=1)
    with pytest.raises(ValueError, match="too few"):
        folds(domains, ids, idx[:2], 3, seed=0)
    with pytest.raises(ValueError, match="at least 2"):
        folds(domains, ids, idx, 1, seed=0)


def test_cross_validate_scores_held_out_choices_and_picks_the_best():
    # Option "a" is worth 1 on even prompts, "b" on odd ones.
    n = 12
    values = torch.tensor([[1.0, 0.0] if i % 2 == 0 else [0.0, 1.0] for i in range(n)])  # [P, O]
    opts = ["a", "b"]
    seen = []

    def choose(params, fit, held):
        assert not set(fit) & set(held)  # never scored on what it was fit on
        seen.append((tuple(fit), tuple(held)))
        if params["rule"] == "parity":
            return ["a" if i % 2 == 0 else "b" for i in held]
        return [params["rule"]] * len(held)

    fold_idx = [list(range(k, n, 3)) for k in range(3)]
    best, scores = cross_validate(
        [{"rule": "a"}, {"rule": "parity"}, {"rule": "b"}], choose, fold_idx, lambda idx: values[idx], opts
    )
    assert best == {"rule": "parity"}
    assert scores == pytest.approx([0.5, 1.0, 0.5])
    assert len(seen) == 9
    # Ties keep the earlier candidate.
    best, _ = cross_validate([{"rule": "b"}, {"rule": "a"}], choose, fold_idx, lambda idx: values[idx], opts)
    assert best == {"rule": "b"}


def test_shrink_pulls_each_row_toward_its_own_domains_mean():
    v = torch.tensor([[0.9, 0.1], [0.5, 0.3], [0.2, 0.8], [0.4, 0.6]])  # [N, O]
    doms = ["code", "code", "math", "math"]
    means = domain_means(v, doms)
    assert torch.allclose(means["code"], torch.tensor([0.7, 0.2])) and torch.allclose(means["math"], torch.tensor([0.3, 0.7]))
    assert torch.equal(shrink_to_domain(v, doms, 0.0), v)
    assert torch.allclose(shrink_to_domain(v, doms, 1.0), torch.stack([means[d] for d in doms]))
    half = shrink_to_domain(v, doms, 0.5)
    assert torch.allclose(half[0], torch.tensor([0.8, 0.15])) and torch.allclose(half[3], torch.tensor([0.35, 0.65]))
    # Other rows shrink toward given (training) means; a domain without one stays as measured.
    other = shrink_to_domain(torch.tensor([[0.1, 0.1], [0.5, 0.5]]), ["math", "chat"], 0.5, means)
    assert torch.allclose(other, torch.tensor([[0.2, 0.4], [0.5, 0.5]]))
