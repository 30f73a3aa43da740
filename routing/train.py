"""train-router: features of the collected prompts -> an MLP predicting each draft's acceptance,
scored on held-out prompts against the oracle, the best single draft, random choice and
scikit-learn baselines (logistic regression classifying the best draft, k-nearest neighbours
regressing acceptance) trained on the same features and split.
"""

from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from routing.config import RouterTrainConfig
from routing.dataset import Table, load_table, split_prompts
from routing.evaluate import evaluate, metric_values, objective_metric, options, write_report
from routing.features import Featurizer
from routing.router import DEFAULT_K_BUCKETS, NONE, Router, RouterMLP, calibrated_verify_cost


def normalisation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and std [F] of training features [N, F]; constant features get std 1."""
    mean, std = x.mean(0), x.std(0, unbiased=False)
    return mean, torch.where(std > 1e-6, std, torch.ones_like(std))


@contextlib.contextmanager
def one_thread():
    """The router MLP is tiny: one thread is fastest, and intra-op threads that wait on each other
    at every small op are slow on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fit_mlp(cfg: RouterTrainConfig, x: torch.Tensor, y: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor) -> tuple[dict, dict]:
    """Full-batch AdamW on normalised features x [N, F] -> acceptance y [N, D] (binary
    cross-entropy against the rates); keeps the epoch with the lowest validation loss (the last
    one without validation prompts). Returns (state_dict, history)."""
    m = cfg.mlp
    torch.manual_seed(m.seed)
    mlp = RouterMLP(x.shape[1], y.shape[1], hidden=m.hidden, layers=m.layers, dropout=m.dropout)
    opt = torch.optim.AdamW(mlp.parameters(), lr=m.lr, weight_decay=m.weight_decay)
    best = (float("inf"), None, -1)
    history = {"train_loss": [], "val_loss": []}
    for epoch in tqdm(range(m.epochs), desc="train-router", unit="epoch", leave=False):
        mlp.train()
        loss = F.binary_cross_entropy_with_logits(mlp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mlp.eval()
        with torch.no_grad():
            val = F.binary_cross_entropy_with_logits(mlp(x_val), y_val).item() if len(x_val) else loss.item()
        history["train_loss"].append(loss.item())
        history["val_loss"].append(val)
        if val < best[0] or not len(x_val):
            best = (val, copy.deepcopy(mlp.state_dict()), epoch)
    history["best_epoch"] = best[2]
    return best[1], history


def baselines(cfg: RouterTrainConfig, router: Router, table: Table, x: torch.Tensor, train_idx, test_idx) -> dict[str, list[str]]:
    """Choices on the test prompts of the scikit-learn baselines, fit on the training prompts'
    normalised features ``x`` [P, F] (the MLP's inputs)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.neighbors import KNeighborsRegressor

    opts = options(table, router)
    key = objective_metric(table, router.objective)
    labels = metric_values(table, train_idx, router)[key].argmax(1).tolist()  # best option per train prompt
    xtr, xte = x[train_idx].numpy(), x[test_idx].numpy()
    if len(set(labels)) == 1:  # one class: LogisticRegression refuses to fit, and the answer is obvious
        logreg = [opts[labels[0]]] * len(test_idx)
    else:
        clf = LogisticRegression(C=cfg.baselines.logreg_c, max_iter=5000).fit(xtr, labels)
        logreg = [opts[j] for j in clf.predict(xte)]
    knn = KNeighborsRegressor(n_neighbors=min(cfg.baselines.knn_k, len(train_idx))).fit(xtr, table.acceptance[train_idx].numpy())
    knn_acc = torch.tensor(knn.predict(xte), dtype=torch.float32).reshape(len(test_idx), -1)  # [N, D]
    return {"logistic regression": logreg, f"knn (k={knn.n_neighbors})": [c.draft for c in router.decide(knn_acc)]}


def train(cfg: RouterTrainConfig) -> dict:
    """Train, evaluate and write router.pt, eval.json, eval.md and eval.png under cfg.output."""
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    table = load_table(cfg.data, cfg.mode)
    if cfg.objective == "speedup" and not table.has_none:
        print(f"train-router: the target alone ({NONE!r}) was not collected: speedups come from the cost model")
    train_idx, val_idx, test_idx = split_prompts(table, cfg.split.test_fraction, cfg.split.val_fraction, cfg.split.seed)
    print(f"train-router: {len(table.prompt_ids)} prompts x {len(table.drafts)} drafts {table.drafts}; "
          f"train {len(train_idx)}, val {len(val_idx)}, test {len(test_idx)}")  # fmt: skip

    featurizer = Featurizer(cfg.features.embedder, cheap=cfg.features.cheap)
    raw = featurizer(table.texts)  # [P, F]
    mean, std = normalisation(raw[train_idx])
    x = (raw - mean) / std  # [P, F]
    y = table.acceptance.clamp(0, 1)  # [P, D]
    with one_thread():
        state, history = fit_mlp(cfg, x[train_idx], y[train_idx], x[val_idx], y[val_idx])

    costs = {d: dict(c) for d, c in table.costs.items()}
    if cfg.calibrate_costs and table.speedup is not None:
        for j, d in enumerate(table.drafts):  # training prompts only: the test split stays unseen
            v = calibrated_verify_cost(table.acceptance[train_idx, j], table.speedup[train_idx, j], table.k, costs[d]["draft_cost"])
            costs[d]["verify_step_cost"] = costs[d]["verify_cost"]
            if math.isfinite(v):
                costs[d]["verify_cost"] = v
        print("train-router: per-call costs fitted to measured speedups: " + ", ".join(
            f"{d} {c['verify_step_cost']:.2f} -> {c['verify_cost']:.2f}" for d, c in costs.items()))  # fmt: skip
    names = table.drafts + ([NONE] if table.has_none else [])
    router = Router(
        draft_names=names,
        draft_refs={**table.draft_refs, NONE: None},
        target_ref=table.target_ref,
        objective=cfg.objective,
        embedder=cfg.features.embedder,
        cheap_features=cfg.features.cheap,
        mean=mean,
        std=std,
        mlp_config={"hidden": cfg.mlp.hidden, "layers": cfg.mlp.layers, "dropout": cfg.mlp.dropout},
        state_dict=state,
        costs=costs,
        k_buckets=list(cfg.k_buckets or DEFAULT_K_BUCKETS),
        info={"trained": True, "data": list(cfg.data), "mode": cfg.mode, "collected_k": table.k},
    )
    policies = {"router (MLP)": [c.draft for c in router.decide(router.predict_from_features(raw[test_idx]))]}
    policies.update(baselines(cfg, router, table, x, train_idx, test_idx))
    # The objective's rule fed the measured acceptance instead of a prediction: what a perfect
    # acceptance predictor would get, so the report separates prediction error from cost-model error.
    policies["hindsight acceptance"] = [c.draft for c in router.decide(table.acceptance[test_idx])]

    report = evaluate(table, train_idx, test_idx, router, policies)
    report["mlp"] = {"best_epoch": history["best_epoch"], "final_train_loss": history["train_loss"][-1],
                     "best_val_loss": min(history["val_loss"])}  # fmt: skip
    report["test_prompt_ids"] = [table.prompt_ids[i] for i in test_idx]
    router.info["eval"] = {name: {k: v for k, v in r.items() if not k.endswith("_by_domain")} for name, r in report["policies"].items()}
    router.save(out / "router.pt")
    write_report(report, out)
    r, key = report["policies"], report["objective_metric"]
    print(f"train-router: {key} on held-out prompts: " + ", ".join(f"{n} {v[key]:.3f}" for n, v in r.items()))
    print(f"train-router: wrote {out / 'router.pt'}, eval.json, eval.md, eval.png")
    return report
