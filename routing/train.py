"""train-router: features of the collected prompts -> an MLP predicting each draft's acceptance,
scored on held-out prompts against the oracle, the best single draft, random choice and
scikit-learn baselines (logistic regression classifying the best draft, k-nearest neighbours
regressing acceptance) trained on the same features, split and labels (each training prompt's
measurement shrunk toward its domain's mean, ``shrink``). The held-out prompts are a split of
``data``, or with ``test_data`` other prompts collected apart. With ``select.folds`` each
family's settings are first chosen by cross-validation on the training prompts (``routing.select``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from routing.config import MLPConfig, RouterTrainConfig
from routing.cost_model import calibrated_verify_cost, fill_of, fit_shift_scale
from routing.dataset import Table, join_tables, load_served, load_table, second_k, split_prompts, step_table
from routing.evaluate import evaluate, metric_values, objective_metric, options, write_report
from routing.features import Featurizer
from routing.router import DEFAULT_K_BUCKETS, NONE, Router, RouterMLP
from routing.select import cross_validate, folds, grid


def normalisation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and std [F] of training features [N, F]; constant features get std 1."""
    mean, std = x.mean(0), x.std(0, unbiased=False)
    return mean, torch.where(std > 1e-6, std, torch.ones_like(std))


def domain_means(values: torch.Tensor, domains: Sequence[str]) -> dict[str, torch.Tensor]:
    """Each domain's mean row [O] of values [N, O] (row i belongs to domains[i])."""
    return {d: values[[i for i, x in enumerate(domains) if x == d]].mean(0) for d in sorted(set(domains))}


def shrink_to_domain(
    values: torch.Tensor, domains: Sequence[str], shrink: float, means: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """values [N, O] pulled toward their domain's mean row: (1 - shrink) * value + shrink * mean.
    ``means`` defaults to the rows' own domain means; pass the training rows' to shrink other rows
    (a row whose domain has no mean stays as measured). Why: one prompt's 32-token acceptance is a
    noisy label; its domain's mean is a far steadier one, and shrinking toward it (empirical Bayes)
    keeps a learner from chasing noise that no feature of the prompt predicts."""
    means = domain_means(values, domains) if means is None else means
    out = values.clone()
    for i, d in enumerate(domains):
        if d in means:
            out[i] = (1 - shrink) * values[i] + shrink * means[d]
    return out


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


def fit_mlp(
    m: MLPConfig, x: torch.Tensor, y: torch.Tensor, x_val: torch.Tensor, y_val: torch.Tensor, progress: bool = True
) -> tuple[dict, dict]:
    """Full-batch AdamW on normalised features x [N, F] -> acceptance y [N, D] (binary
    cross-entropy against the rates, over the entries that were measured: NaN marks a drafter a
    served prompt did not run); keeps the epoch with the lowest validation loss (the last one
    without validation prompts). Returns (state_dict, history)."""
    torch.manual_seed(m.seed)
    mlp = RouterMLP(x.shape[1], y.shape[1], hidden=m.hidden, layers=m.layers, dropout=m.dropout)
    opt = torch.optim.AdamW(mlp.parameters(), lr=m.lr, weight_decay=m.weight_decay)
    best = (float("inf"), None, -1)
    history = {"train_loss": [], "val_loss": []}
    seen = ~torch.isnan(y)  # [N, D]
    y = torch.nan_to_num(y)
    for epoch in tqdm(range(m.epochs), desc="train-router", unit="epoch", leave=False, disable=not progress):
        mlp.train()
        loss = F.binary_cross_entropy_with_logits(mlp(x)[seen], y[seen])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mlp.eval()
        with torch.no_grad():
            val = F.binary_cross_entropy_with_logits(mlp(x_val), y_val).item() if len(x_val) else loss.item()
        history["train_loss"].append(loss.item())
        history["val_loss"].append(val)
        if len(x_val) and val < best[0]:
            best = (val, copy.deepcopy(mlp.state_dict()), epoch)
    if not len(x_val):
        best = (history["val_loss"][-1], copy.deepcopy(mlp.state_dict()), m.epochs - 1)
    history["best_epoch"] = best[2]
    return best[1], history


class Policies:
    """The router MLP and the scikit-learn baselines as ``choose(params, fit_idx, eval_idx)``
    functions over one table's normalised features ``x`` [P, F]: fit on ``fit_idx``, return one
    option per ``eval_idx`` prompt by the router's rule (``routing.select``). All three learn from
    labels shrunk toward their domain's mean by ``params["shrink"]`` (default ``cfg.shrink``)."""

    def __init__(self, cfg: RouterTrainConfig, router: Router, table: Table, x: torch.Tensor) -> None:
        self.cfg, self.router, self.table, self.x = cfg, router, table, x
        self.opts = options(table, router)
        self.key = objective_metric(table, router.objective)
        self.y = table.acceptance.clamp(0, 1)  # [P, D]

    def values(self, idx: list[int]) -> torch.Tensor:
        """Measured objective [len(idx), O] of every option."""
        return metric_values(self.table, idx, self.router)[self.key]

    def labels(self, values: torch.Tensor, fit: list[int], shrink: float) -> torch.Tensor:
        """values [len(fit), O] of the fit prompts, shrunk toward their domain's mean."""
        return shrink_to_domain(values, [self.table.domains[i] for i in fit], shrink)

    def split(self, params: dict) -> tuple[dict, float]:
        """A family's own settings, and the shrink to learn with."""
        rest = {k: v for k, v in params.items() if k != "shrink"}
        return rest, float(params.get("shrink", self.cfg.shrink))

    def mlp(self, params: dict, fit: list[int], held: list[int]) -> list[str]:
        params, shrink = self.split(params)
        m = self.cfg.mlp.with_settings(params)
        state, _ = fit_mlp(m, self.x[fit], self.labels(self.y[fit], fit, shrink), self.x[:0], self.y[:0], progress=False)
        net = RouterMLP(self.x.shape[1], self.y.shape[1], hidden=m.hidden, layers=m.layers, dropout=m.dropout)
        net.load_state_dict(state)
        with torch.no_grad():
            return [c.draft for c in self.router.decide(torch.sigmoid(net.eval()(self.x[held])), 1, self.table.lengths(held))]

    def logreg(self, params: dict, fit: list[int], held: list[int]) -> list[str]:
        from sklearn.linear_model import LogisticRegression

        params, shrink = self.split(params)
        labels = self.labels(self.values(fit), fit, shrink).argmax(1).tolist()  # best option per fit prompt
        if len(set(labels)) == 1:  # one class: LogisticRegression refuses to fit, and the answer is obvious
            return [self.opts[labels[0]]] * len(held)
        clf = LogisticRegression(C=params["C"], max_iter=5000).fit(self.x[fit].numpy(), labels)
        return [self.opts[j] for j in clf.predict(self.x[held].numpy())]

    def knn(self, params: dict, fit: list[int], held: list[int]) -> list[str]:
        from sklearn.neighbors import KNeighborsRegressor

        params, shrink = self.split(params)
        y = self.labels(self.y[fit], fit, shrink)  # [len(fit), D]
        knn = KNeighborsRegressor(n_neighbors=min(int(params["k"]), len(fit))).fit(self.x[fit].numpy(), y.numpy())
        pred = torch.tensor(knn.predict(self.x[held].numpy()), dtype=torch.float32).reshape(len(held), -1)  # [N, D]
        return [c.draft for c in self.router.decide(pred, 1, self.table.lengths(held))]


def select_settings(cfg: RouterTrainConfig, policies: Policies, table: Table, fit_idx: list[int]) -> dict:
    """Cross-validate each family's candidate settings on ``fit_idx`` (``routing.select``):
    {"mlp" | "logreg" | "knn": {"chosen": params, "candidates": [{"params", "score"}]}}."""
    fold_idx = folds(table.domains, table.prompt_ids, fit_idx, cfg.select.folds, cfg.select.seed)
    shrink = {"shrink": cfg.select.shrink} if cfg.select.shrink else {}
    families = {
        "mlp": (grid({**cfg.select.mlp, **shrink}), policies.mlp),
        "logreg": (grid({"C": cfg.select.logreg_c, **shrink}), policies.logreg),
        "knn": (grid({"k": cfg.select.knn_k, **shrink}), policies.knn),
    }
    out = {}
    with one_thread():
        for name, (candidates, choose) in tqdm(families.items(), desc="cross-validation", unit="family", leave=False):
            chosen, scores = cross_validate(candidates, choose, fold_idx, policies.values, policies.opts)
            out[name] = {"chosen": chosen, "candidates": [{"params": c, "score": v} for c, v in zip(candidates, scores)]}
    return out


def train(cfg: RouterTrainConfig) -> dict:
    """Train, evaluate and write router.pt, eval.json, eval.md and eval.png under cfg.output."""
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    table = load_table(cfg.data, cfg.mode)
    if cfg.objective == "speedup" and not table.has_none:
        print(f"train-router: the target alone ({NONE!r}) was not collected: speedups come from the cost model")
    fixed = table.splits is not None and all(s in ("train", "val") for s in table.splits)
    if table.splits is not None and "test" in table.splits:
        raise ValueError(f"{cfg.data} hold prompts of the workload's test split: collect them apart and pass them as "
                         "test_data, so that nothing is fit or tuned on them")  # fmt: skip
    if fixed and not cfg.test_data:
        raise ValueError("the rows are workload rows (train and val splits): pass the test split's rows as test_data")
    if fixed:  # the workload's fixed split: train and val as collected, test from test_data
        train_idx = [i for i, s in enumerate(table.splits) if s == "train"]
        val_idx = [i for i, s in enumerate(table.splits) if s == "val"]
        n_data = len(table.prompt_ids)
        table = join_tables(table, load_table(cfg.test_data, cfg.mode))
        test_idx = list(range(n_data, len(table.prompt_ids)))
    elif cfg.test_data:  # a test set collected apart: every data prompt trains (but the val ones)
        train_idx, val_idx, _ = split_prompts(table, 0.0, cfg.split.val_fraction, cfg.split.seed)
        n_data = len(table.prompt_ids)
        table = join_tables(table, load_table(cfg.test_data, cfg.mode))
        test_idx = list(range(n_data, len(table.prompt_ids)))
    else:
        train_idx, val_idx, test_idx = split_prompts(table, cfg.split.test_fraction, cfg.split.val_fraction, cfg.split.seed)
    print(f"train-router: {len(table.prompt_ids)} prompts x {len(table.drafts)} drafts {table.drafts}; "
          f"train {len(train_idx)}, val {len(val_idx)}, test {len(test_idx)}")  # fmt: skip

    # With cross-validation the val prompts join the training prompts: folds replace them.
    cv = cfg.select.folds > 0
    fit_idx = sorted(train_idx + val_idx) if cv else train_idx
    featurizer = Featurizer(cfg.features.embedder, cheap=cfg.features.cheap)
    raw = featurizer(table.texts)  # [P, F]
    mean, std = normalisation(raw[fit_idx])
    x = (raw - mean) / std  # [P, F]

    steps = step_table(cfg.step_profile, table.target_weights) if cfg.step_profile else None  # verifies under load
    # Whole requests are priced with their prefills where the rows measured them (routing.cost_model).
    prefill = table.prefill if cfg.prefill and table.prompt_tokens is not None else None
    costs = {d: dict(c) for d, c in table.costs.items()}
    if prefill is None:  # the prompt's length prices nothing (table.lengths is then ignored): one fill per drafter
        for c in costs.values():
            c.pop("fill_line", None)
    if cfg.calibrate_costs and table.speedup is not None:
        for j, d in enumerate(table.drafts):  # training prompts only: the test split stays unseen
            v = calibrated_verify_cost(table.acceptance[fit_idx, j], table.speedup[fit_idx, j], table.k, costs[d]["draft_cost"],
                                       fill_of(costs[d], table.lengths(fit_idx)), prompt_tokens=table.lengths(fit_idx), prefill=prefill,
                                       draft=d)  # fmt: skip
            costs[d]["verify_step_cost"] = costs[d]["verify_cost"]
            if math.isfinite(v):
                costs[d]["verify_cost"] = v
        print("train-router: per-call costs fitted to measured speedups: " + ", ".join(
            f"{d} {c['verify_step_cost']:.2f} -> {c['verify_cost']:.2f}" for d, c in costs.items()))  # fmt: skip
    names = table.drafts + ([NONE] if table.has_none else [])

    def make_router(m: MLPConfig, state: dict | None) -> Router:
        return Router(
            draft_names=names,
            draft_refs={**table.draft_refs, NONE: None},
            target_ref=table.target_ref,
            objective=cfg.objective,
            embedder=cfg.features.embedder,
            cheap_features=cfg.features.cheap,
            mean=mean,
            std=std,
            mlp_config={"hidden": m.hidden, "layers": m.layers, "dropout": m.dropout},
            state_dict=state,
            costs=costs,
            k_buckets=list(cfg.k_buckets or DEFAULT_K_BUCKETS),
            info={"trained": True, "data": list(cfg.data), "served": list(cfg.served), "test_data": list(cfg.test_data), "mode": cfg.mode, "collected_k": table.k,
                  "target_weights": table.target_weights, "draft_weights": table.draft_weights,
                  "step_model": table.step_model, "step_table": steps, "step_profile": cfg.step_profile, "curve_data": list(cfg.curve_data),
                  "prefill": prefill},
        )

    if cfg.curve_data:  # the wider verify's cost, from the training prompts' speedups at a second K
        probe = make_router(cfg.mlp, None).cost_model
        for d, got in second_k(cfg.data, cfg.curve_data, {table.prompt_ids[i] for i in fit_idx}, table.k, cfg.mode).items():
            if d not in costs:
                continue
            lengths = got["prompt_tokens"] if prefill else None
            before = probe.mean_speedup_at(d, got["rates"], got["k"], lengths)
            costs[d]["verify_shift_scale"] = fit_shift_scale(probe, d, got["rates"], got["speedups"], got["k"], lengths)
            print(f"train-router: {d}'s wider verify weighed x{costs[d]['verify_shift_scale']:.2f} from its speedups at K = "
                  f"{got['k']} on {len(got['prompts'])} training prompts: measured {float(got['speedups'].mean()):.3f}, "
                  f"predicted {before:.3f} unscaled")  # fmt: skip

    # The decision rule (objective, costs) does not depend on the MLP: the selection and the
    # baselines use it before the MLP is fit.
    policies = Policies(cfg, make_router(cfg.mlp, None), table, x)
    selection = select_settings(cfg, policies, table, fit_idx) if cv else None
    mlp_params, shrink = policies.split(selection["mlp"]["chosen"] if cv else {})
    mlp_cfg = cfg.mlp.with_settings(mlp_params)
    logreg = selection["logreg"]["chosen"] if cv else {"C": cfg.baselines.logreg_c}
    knn = selection["knn"]["chosen"] if cv else {"k": cfg.baselines.knn_k}
    if cv:
        print("train-router: chosen by cross-validation: MLP " + ", ".join(f"{k}={v}" for k, v in selection["mlp"]["chosen"].items())
              + f"; logistic regression {logreg}; kNN {knn}")  # fmt: skip
    val = [] if cv else val_idx
    # The val prompts (epoch pick) are shrunk toward the training prompts' domain means.
    fit_domains = [table.domains[i] for i in fit_idx]
    means = domain_means(policies.y[fit_idx], fit_domains)
    y_fit = shrink_to_domain(policies.y[fit_idx], fit_domains, shrink, means)  # [len(fit), D]
    y_val = shrink_to_domain(policies.y[val], [table.domains[i] for i in val], shrink, means)  # [len(val), D]
    x_fit = x[fit_idx]
    if cfg.served:  # served requests: one measured drafter each, shrunk toward the served rows' mean
        served = load_served(cfg.served, table, cfg.mode)
        m = torch.nanmean(served.acceptance, dim=0)  # [D]; NaN for a drafter no served request ran
        y_served = torch.where(torch.isnan(m), served.acceptance, (1 - shrink) * served.acceptance + shrink * m)  # [S, D]
        x_fit = torch.cat([x_fit, (featurizer(served.texts) - mean) / std])
        y_fit = torch.cat([y_fit, y_served])
        print(f"train-router: + {len(served.texts)} served prompts ({int((~torch.isnan(y_served)).sum())} measured entries)")
    with one_thread():
        state, history = fit_mlp(mlp_cfg, x_fit, y_fit, x[val], y_val)
    router = make_router(mlp_cfg, state)
    router.info["shrink"] = shrink
    if cv:
        router.info["selection"] = selection

    choices = {"router (MLP)": [c.draft for c in router.decide(router.predict_from_features(raw[test_idx]), 1, table.lengths(test_idx))]}
    choices["logistic regression"] = policies.logreg(logreg, fit_idx, test_idx)
    choices[f"knn (k={min(int(knn['k']), len(fit_idx))})"] = policies.knn(knn, fit_idx, test_idx)
    # The objective's rule fed the measured acceptance instead of a prediction: what a perfect
    # acceptance predictor would get, so the report separates prediction error from cost-model error.
    choices["hindsight acceptance"] = [c.draft for c in router.decide(table.acceptance[test_idx], 1, table.lengths(test_idx))]

    report = evaluate(table, fit_idx, test_idx, router, choices)
    report["mlp"] = {"best_epoch": history["best_epoch"], "final_train_loss": history["train_loss"][-1],
                     "best_val_loss": min(history["val_loss"]), "settings": dataclasses.asdict(mlp_cfg)}  # fmt: skip
    report["shrink"] = {"mlp": shrink, "logistic regression": policies.split(logreg)[1], "knn": policies.split(knn)[1]}
    if selection is not None:
        report["selection"] = selection
    report["test_prompt_ids"] = [table.prompt_ids[i] for i in test_idx]
    report["test_data"] = list(cfg.test_data)
    router.info["eval"] = {name: {k: v for k, v in r.items() if not k.endswith("_by_domain")} for name, r in report["policies"].items()}
    router.save(out / "router.pt")
    write_report(report, out)
    r, key = report["policies"], report["objective_metric"]
    print(f"train-router: {key} on held-out prompts: " + ", ".join(f"{n} {v[key]:.3f}" for n, v in r.items()))
    print(f"train-router: wrote {out / 'router.pt'}, eval.json, eval.md, eval.png")
    return report
