"""Model selection by k-fold cross-validation on the training prompts.

A policy family (the router MLP, logistic regression, k-nearest neighbours) is a function
``choose(params, fit_idx, eval_idx) -> one option per eval prompt``. Each candidate setting is fit
on k-1 folds and scored on the held-out fold by what the router is for: the mean measured value of
the objective (acceptance, or measured speedup) of the options it chose. The setting with the best
mean over the folds wins; ties keep the earlier candidate. The test prompts are never seen.
"""

from __future__ import annotations

import itertools
import random
from typing import Callable, Sequence

import torch

Choose = Callable[[dict, list[int], list[int]], list[str]]


def grid(spec: dict[str, Sequence]) -> list[dict]:
    """Every combination of the listed values, in the order given: {"a": [1, 2], "b": [3]} ->
    [{"a": 1, "b": 3}, {"a": 2, "b": 3}]. An empty spec is one candidate, {}."""
    keys = list(spec)
    return [dict(zip(keys, values)) for values in itertools.product(*(spec[k] for k in keys))]


def folds(domains: Sequence[str], prompt_ids: Sequence[str], idx: Sequence[int], n: int, seed: int) -> list[list[int]]:
    """``idx`` split into ``n`` folds, stratified by domain and deterministic in (prompt ids, seed):
    each domain's prompts are shuffled and dealt round-robin, so every fold sees every domain."""
    if n < 2:
        raise ValueError(f"cross-validation needs at least 2 folds, got {n}")
    if len(idx) < n:
        raise ValueError(f"{len(idx)} training prompts are too few for {n} folds: lower select.folds")
    out: list[list[int]] = [[] for _ in range(n)]
    dealt = 0
    for domain in sorted({domains[i] for i in idx}):
        mine = sorted((i for i in idx if domains[i] == domain), key=lambda i: prompt_ids[i])
        random.Random(f"cv{seed}/{domain}").shuffle(mine)
        for i in mine:  # continue the deal across domains so fold sizes differ by at most one
            out[dealt % n].append(i)
            dealt += 1
    return [sorted(f) for f in out]


def cross_validate(
    candidates: list[dict], choose: Choose, fold_idx: list[list[int]], values: Callable[[list[int]], torch.Tensor], opts: list[str]
) -> tuple[dict, list[float]]:
    """Pick the candidate whose choices score best on held-out folds.

    values(idx) -> measured objective [len(idx), len(opts)] of every option on those prompts.
    Returns (best candidate, mean held-out score of each candidate)."""
    if not candidates:
        raise ValueError("no candidate settings to cross-validate")
    scores = []
    for params in candidates:
        total, count = 0.0, 0
        for k, held in enumerate(fold_idx):
            fit = sorted(i for j, f in enumerate(fold_idx) if j != k for i in f)
            chosen = choose(params, fit, held)
            v = values(held)  # [n, O]
            total += float(sum(v[r, opts.index(c)] for r, c in enumerate(chosen)))
            count += len(held)
        scores.append(total / count)
    best = max(range(len(candidates)), key=lambda j: (scores[j], -j))
    return candidates[best], scores
