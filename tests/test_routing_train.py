"""train-router on a small fixed set of rows: what it writes is pinned, so a change to how the
training is organised (its steps, their order) that changes the router shows here. The values were
recorded from train-router before it became a recipe; the rows exercise every step (the cost
calibration, the wider verify's scale from rows at K = 8, a step table, prefills, served requests,
cross-validation). And the recipe's steps before ``evaluate`` never read the held-out prompts'
measurements."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from routing.config import RouterTrainConfig
from routing.router import NONE, Router
from routing.train import TrainRouterRecipe, train

pytestmark = pytest.mark.integration

TEXTS = {
    "code": [f"def helper_{i}(values, key):\n    return sorted(values, key=key)[{i}] + {i * 7}" for i in range(11)],
    "chat": [f"Write a friendly note to my neighbour number {i} about the garden party on day {i + 3}." for i in range(11)],
    "edit": ["Rewrite this paragraph in plain words, keeping every name: " + "Alice met Bob at the station. " * (1 + i % 5)
             for i in range(11)],
}  # fmt: skip
# Each domain's mean acceptance per drafter; every row draws its own around it.
ACCEPTANCE = {"code": {"ngram": 0.7, "model": 0.5}, "chat": {"ngram": 0.1, "model": 0.65}, "edit": {"ngram": 0.8, "model": 0.55}}


# Recorded from train-router before it became a recipe (routing.train at 721f757).
PINNED_COSTS = {
    "model": {"draft_cost": 0.264126651430923, "verify_cost": 1.1595202684402466, "fill": 1.0, "fill_line": [1.0, 0.0],
              "verify_step_cost": 1.3514137619190498},
    "ngram": {"draft_cost": 0.0, "verify_cost": 1.6775332689285278, "fill": 0.6, "fill_line": [0.6, 0.0],
              "verify_step_cost": 1.337944179647766, "verify_shift_scale": 1.0501226782780577},
}  # fmt: skip
PINNED_MLP = {"hidden": 32, "epochs": 40, "shrink": 0.75}
PINNED_BEST_EPOCH = 39
PINNED_PREDICTED = [[0.4495, 0.6713], [0.4493, 0.66], [0.4647, 0.6639], [0.5832, 0.1863], [0.5871, 0.1693], [0.5804, 0.1954],
                    [0.5847, 0.7896], [0.5816, 0.7854], [0.6035, 0.8155]]  # fmt: skip
PINNED_CHOICES = [("ngram", 8)] * 3 + [("model", 1)] * 3 + [("ngram", 8)] * 3
PINNED_CHOICES_AT_8 = [("ngram", 4)] * 3 + [(NONE, 0)] * 3 + [("ngram", 6)] * 3
PINNED_SCORES = {"oracle": 1.4699, "best single (ngram)": 1.270002, "random": 1.17962, "router (MLP)": 1.4699,
                 "logistic regression": 1.4699, "knn (k=3)": 1.4699, "hindsight acceptance": 1.448846}  # fmt: skip


def _row(rng: random.Random, pid: str, domain: str, text: str, draft: str, k: int = 4) -> dict:
    tokens = 20 + 9 * len(text.split())
    step = 90.0 + 10 * rng.random()
    acc = 0.0 if draft == NONE else min(0.98, max(0.01, ACCEPTANCE.get(domain, ACCEPTANCE["chat"])[draft] + rng.gauss(0, 0.12)))
    speedup = 1.0 if draft == NONE else (0.7 + 1.1 * acc + rng.gauss(0, 0.05)) * (1.1 if k == 8 else 1.0)
    per_call = 1.0 if draft == NONE else 1 + k * acc * (0.6 if draft == "ngram" else 1.0)
    prefill = step * (0.5 + 0.03 * tokens) + (step * (0.2 + 0.01 * tokens) if draft == "model" else 0.0)
    return {"prompt_id": pid, "domain": domain, "text": text, "use_chat_template": True, "draft": draft,
            "draft_ref": None if draft == NONE else ("ngram" if draft == "ngram" else f"ref-{draft}"), "target": "target",
            "target_weights": "int8", "mode": "greedy", "repeat": 0, "k": 0 if draft == NONE else k, "acceptance_rate": acc,
            "speedup": speedup, "draft_step_ms": 25.0 if draft == "model" else 0.0,
            "target_step_ms": step if draft == NONE else 1.35 * step, "prompt_tokens": tokens, "prefill_ms": prefill,
            "new_tokens": 48, "target_calls": 20, "mean_accepted_length": per_call}  # fmt: skip


def _rows(path: Path, prompts: range, seed: int, k: int = 4, drafts=(NONE, "ngram", "model")) -> str:
    rng = random.Random(seed)
    rows = [_row(rng, f"{domain}/{i}", domain, texts[i], d, k) for domain, texts in TEXTS.items() for i in prompts for d in drafts]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Collected rows of 8 training and 3 test prompts per domain, the training prompts' `ngram`
    again at K = 8, six served requests of `model`, and a step profile of 1, 4 and 8 rows."""
    root = tmp_path_factory.mktemp("train-router")
    rng = random.Random(4)
    served = root / "served.jsonl"
    served.write_text("".join(json.dumps(_row(rng, f"served/{i}", "chat", f"Translate sentence {i} into French.", "model")
                                         | {"source": "served"}) + "\n" for i in range(6)))  # fmt: skip
    profile = root / "profile.json"
    profile.write_text(json.dumps({"weights": "int8", "rows": [{"path": "p", "batch_rows": b, "tokens": t, "step_ms": 80 + 8 * b * t + 3 * t}
                                                              for b in (1, 4, 8) for t in (1, 2, 3, 5, 9)]}))  # fmt: skip
    cfg = RouterTrainConfig(data=[_rows(root / "rows.jsonl", range(8), 1)], test_data=[_rows(root / "test.jsonl", range(8, 11), 2)],
                            curve_data=[_rows(root / "k8.jsonl", range(8), 3, k=8, drafts=("ngram",))], served=[str(served)],
                            step_profile=str(profile), objective="speedup", output=str(root / "router"))  # fmt: skip
    cfg.mlp.epochs = 40
    cfg.select.folds = 2
    cfg.select.mlp = {"hidden": [16, 32], "epochs": [20, 40]}
    cfg.select.logreg_c, cfg.select.knn_k, cfg.select.shrink = [0.1, 1.0], [3], [0.5, 0.75]
    report = train(cfg)
    return report, Router.load(root / "router" / "router.pt")


def test_the_costs_and_settings_are_what_train_router_fitted_before(trained):
    report, router = trained
    assert {d: set(c) for d, c in router.costs.items()} == {d: set(c) for d, c in PINNED_COSTS.items()}
    for d, costs in PINNED_COSTS.items():
        for name, value in costs.items():
            assert router.costs[d][name] == pytest.approx(value, rel=1e-5, abs=1e-9), (d, name)
    assert router.info["selection"]["mlp"]["chosen"] == PINNED_MLP and router.info["shrink"] == PINNED_MLP["shrink"]
    assert report["mlp"]["best_epoch"] == PINNED_BEST_EPOCH and report["n_train"] == 24 and report["n_test"] == 9


def test_the_choices_and_the_scores_are_what_train_router_gave_before(trained):
    report, router = trained
    test = [TEXTS[d][i] for d in TEXTS for i in range(8, 11)]
    lengths = [20 + 9 * len(t.split()) for t in test]
    predicted = router.predict_acceptance(test)  # [9, D]
    torch.testing.assert_close(predicted, torch.tensor(PINNED_PREDICTED), atol=2e-4, rtol=0)
    assert [(c.draft, c.k) for c in router.choose_batch(test, 1, lengths)] == PINNED_CHOICES
    assert [(c.draft, c.k) for c in router.choose_batch(test, 8, lengths)] == PINNED_CHOICES_AT_8
    key = report["objective_metric"]
    assert {name: r[key] for name, r in report["policies"].items()} == pytest.approx(PINNED_SCORES, abs=1e-6)


def test_the_held_out_prompts_measurements_change_nothing_before_evaluate(tmp_path):
    """Two runs whose test prompts measured differently: the same split, costs, settings and MLP."""
    data = _rows(tmp_path / "rows.jsonl", range(8), 1)
    fitted = []
    for seed in (2, 7):
        cfg = RouterTrainConfig(data=[data], test_data=[_rows(tmp_path / f"test{seed}.jsonl", range(8, 11), seed)],
                                objective="speedup", output=str(tmp_path / f"router{seed}"))  # fmt: skip
        cfg.mlp.epochs = 10
        recipe = TrainRouterRecipe(cfg)
        recipe.setup()
        recipe.price()
        recipe.select()
        recipe.fit()
        fitted.append(recipe)
    a, b = fitted
    assert a.test_idx == b.test_idx and a.fit_idx == b.fit_idx and a.costs == b.costs and a.mlp_cfg == b.mlp_cfg
    assert not torch.equal(a.table.acceptance[a.test_idx], b.table.acceptance[b.test_idx])
    for name, weight in a.router.mlp.state_dict().items():
        assert torch.equal(weight, b.router.mlp.state_dict()[name]), name
    assert not (tmp_path / "router2" / "router.pt").exists()  # save() writes, no step before it
