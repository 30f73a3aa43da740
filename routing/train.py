"""train-router: features of the collected prompts -> an MLP predicting each draft's acceptance,
scored on held-out prompts against the oracle, the best single draft, random choice and
scikit-learn baselines (logistic regression classifying the best draft, k-nearest neighbours
regressing acceptance) trained on the same features, split and labels (each training prompt's
measurement shrunk toward its domain's mean, ``shrink``). The held-out prompts are a split of
``data``, or with ``test_data`` other prompts collected apart. With ``select.folds`` each
family's settings are first chosen by cross-validation on the training prompts (``routing.select``).

One run is a ``TrainRouterRecipe``: ``setup`` (rows, split, features), ``price`` (the drafters'
costs), ``select`` (settings), ``fit`` (the MLP), ``evaluate`` (held-out scores), ``save``
(router.pt and the report). ``train(cfg)`` runs them in order.
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
from routing.cost_model import CostModel, calibrated_verify_cost, fill_of, fit_shift_scale
from routing.dataset import Table, join_tables, load_served, load_table, second_k, split_prompts, step_table
from routing.evaluate import evaluate as score_policies
from routing.evaluate import metric_values, objective_metric, options, write_report
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


class TrainRouterRecipe:
    """One train-router run, in the shape of ``training.train.TrainDraftRecipe``:

        recipe = TrainRouterRecipe(cfg)
        recipe.setup()              # the rows, their train/val/test split, the prompts' features
        recipe.price()              # each drafter's costs, fitted on the training prompts
        recipe.select()             # the MLP's and the baselines' settings (cross-validated with select.folds)
        recipe.fit()                # the MLP on the training prompts and served requests -> recipe.router
        report = recipe.evaluate()  # the router and the baselines scored on the held-out prompts
        recipe.save()               # router.pt, eval.json, eval.md and eval.png under cfg.output

    Each step reads what the steps before it left on the recipe. Only ``evaluate`` reads the
    held-out prompts' measurements: nothing is fit or tuned on them.
    """

    def __init__(self, cfg: RouterTrainConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output)

    # ---- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        """The collected rows as one table, the prompts' split, and their features normalised
        with the training prompts' statistics."""
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        self.table = load_table(cfg.data, cfg.mode)
        if cfg.objective == "speedup" and not self.table.has_none:
            print(f"train-router: the target alone ({NONE!r}) was not collected: speedups come from the cost model")
        self.table, self.train_idx, self.val_idx, self.test_idx = self._split(self.table)
        print(f"train-router: {len(self.table.prompt_ids)} prompts x {len(self.table.drafts)} drafts {self.table.drafts}; "
              f"train {len(self.train_idx)}, val {len(self.val_idx)}, test {len(self.test_idx)}")  # fmt: skip
        # With cross-validation the val prompts join the training prompts: folds replace them.
        self.cv = cfg.select.folds > 0
        self.fit_idx = sorted(self.train_idx + self.val_idx) if self.cv else self.train_idx
        self.featurizer = Featurizer(cfg.features.embedder, cheap=cfg.features.cheap)
        self.raw = self.featurizer(self.table.texts)  # [P, F]
        self.mean, self.std = normalisation(self.raw[self.fit_idx])  # [F] each
        self.x = (self.raw - self.mean) / self.std  # [P, F]

    def _split(self, table: Table) -> tuple[Table, list[int], list[int], list[int]]:
        """The table with ``test_data``'s prompts joined after ``data``'s, and the train, val and
        test prompts' indices: workload rows keep their fixed train and val split (the test split
        must come as ``test_data``), other rows are split by ``split`` (all but val train when
        ``test_data`` is given)."""
        cfg = self.cfg
        fixed = table.splits is not None and all(s in ("train", "val") for s in table.splits)
        if table.splits is not None and "test" in table.splits:
            raise ValueError(f"{cfg.data} hold prompts of the workload's test split: collect them apart and pass them as "
                             "test_data, so that nothing is fit or tuned on them")  # fmt: skip
        if fixed and not cfg.test_data:
            raise ValueError("the rows are workload rows (train and val splits): pass the test split's rows as test_data")
        if not cfg.test_data:
            return table, *split_prompts(table, cfg.split.test_fraction, cfg.split.val_fraction, cfg.split.seed)
        if fixed:  # the workload's fixed split: train and val as collected
            train_idx = [i for i, s in enumerate(table.splits) if s == "train"]
            val_idx = [i for i, s in enumerate(table.splits) if s == "val"]
        else:  # a test set collected apart: every data prompt trains (but the val ones)
            train_idx, val_idx, _ = split_prompts(table, 0.0, cfg.split.val_fraction, cfg.split.seed)
        n_data = len(table.prompt_ids)
        table = join_tables(table, load_table(cfg.test_data, cfg.mode))
        return table, train_idx, val_idx, list(range(n_data, len(table.prompt_ids)))

    def _info(self) -> dict:
        """router.pt's ``info``: where the router came from, and the measurements its cost model
        reads (``routing.cost_model``)."""
        cfg, t = self.cfg, self.table
        return {"trained": True, "data": list(cfg.data), "served": list(cfg.served), "test_data": list(cfg.test_data),
                "mode": cfg.mode, "collected_k": t.k, "target_weights": t.target_weights, "draft_weights": t.draft_weights,
                "step_model": t.step_model, "step_table": self.steps, "step_profile": cfg.step_profile,
                "curve_data": list(cfg.curve_data), "prefill": self.prefill}  # fmt: skip

    def _router(self, m: MLPConfig, state: dict | None) -> Router:
        """A router with this run's drafts, costs and features; ``state``: the MLP's weights (None:
        untrained, for the decision rule alone)."""
        cfg, t = self.cfg, self.table
        return Router(
            draft_names=t.drafts + ([NONE] if t.has_none else []),
            draft_refs={**t.draft_refs, NONE: None},
            target_ref=t.target_ref,
            objective=cfg.objective,
            embedder=cfg.features.embedder,
            cheap_features=cfg.features.cheap,
            mean=self.mean,
            std=self.std,
            mlp_config={"hidden": m.hidden, "layers": m.layers, "dropout": m.dropout},
            state_dict=state,
            costs=self.costs,
            k_buckets=list(cfg.k_buckets or DEFAULT_K_BUCKETS),
            info=self._info(),
        )

    # ---- pricing -------------------------------------------------------------------------------

    def price(self) -> None:
        """Each drafter's costs for the cost model (``routing.cost_model``), from the rows of the
        training prompts only: the measured steps, the per-call cost fitted to the measured speedups
        (``calibrate_costs``), the wider verify's scale from rows at a second K (``curve_data``)."""
        cfg, table = self.cfg, self.table
        self.steps = step_table(cfg.step_profile, table.target_weights) if cfg.step_profile else None  # verifies under load
        # Whole requests are priced with their prefills where the rows measured them.
        self.prefill = table.prefill if cfg.prefill and table.prompt_tokens is not None else None
        self.costs = {d: dict(c) for d, c in table.costs.items()}
        if self.prefill is None:  # the prompt's length prices nothing (table.lengths is then ignored): one fill per drafter
            for c in self.costs.values():
                c.pop("fill_line", None)
        if cfg.calibrate_costs and table.speedup is not None:
            self._calibrate()
        if cfg.curve_data:
            self._scale_wider_verify()

    def _calibrate(self) -> None:
        """Each drafter's per-call cost v fitted to the training prompts' measured speedups (the
        bare verify step kept as ``verify_step_cost``, and as v where the fit fails)."""
        table, fit, costs = self.table, self.fit_idx, self.costs
        lengths = table.lengths(fit)
        for j, d in enumerate(table.drafts):
            v = calibrated_verify_cost(table.acceptance[fit, j], table.speedup[fit, j], table.k, costs[d]["draft_cost"],
                                       fill_of(costs[d], lengths), prompt_tokens=lengths, prefill=self.prefill, draft=d)  # fmt: skip
            costs[d]["verify_step_cost"] = costs[d]["verify_cost"]
            if math.isfinite(v):
                costs[d]["verify_cost"] = v
        print("train-router: per-call costs fitted to measured speedups: " + ", ".join(
            f"{d} {c['verify_step_cost']:.2f} -> {c['verify_cost']:.2f}" for d, c in costs.items()))  # fmt: skip

    def _scale_wider_verify(self) -> None:
        """The wider verify's cost, from the training prompts' speedups at a second K: each drafter
        found in ``curve_data`` gets the scale that makes the model's mean speedup there the measured one."""
        cfg, table = self.cfg, self.table
        probe = CostModel(table.drafts, table.draft_refs, self.costs, list(cfg.k_buckets or DEFAULT_K_BUCKETS), self._info())
        fit_prompts = {table.prompt_ids[i] for i in self.fit_idx}
        for d, got in second_k(cfg.data, cfg.curve_data, fit_prompts, table.k, cfg.mode).items():
            if d not in self.costs:
                continue
            lengths = got["prompt_tokens"] if self.prefill else None
            before = probe.mean_speedup_at(d, got["rates"], got["k"], lengths)
            self.costs[d]["verify_shift_scale"] = fit_shift_scale(probe, d, got["rates"], got["speedups"], got["k"], lengths)
            print(f"train-router: {d}'s wider verify weighed x{self.costs[d]['verify_shift_scale']:.2f} from its speedups at K = "
                  f"{got['k']} on {len(got['prompts'])} training prompts: measured {float(got['speedups'].mean()):.3f}, "
                  f"predicted {before:.3f} unscaled")  # fmt: skip

    # ---- settings ------------------------------------------------------------------------------

    def select(self) -> None:
        """The settings the MLP and the baselines learn with: with ``select.folds``, each family's
        chosen by cross-validation on the training prompts (``routing.select``), else as configured.
        The decision rule (objective, costs) does not depend on the MLP: the selection and the
        baselines use it before the MLP is fit."""
        cfg = self.cfg
        self.policies = Policies(cfg, self._router(cfg.mlp, None), self.table, self.x)
        self.selection = select_settings(cfg, self.policies, self.table, self.fit_idx) if self.cv else None
        chosen = {family: s["chosen"] for family, s in self.selection.items()} if self.selection else None
        mlp_params, self.shrink = self.policies.split(chosen["mlp"] if chosen else {})
        self.mlp_cfg = cfg.mlp.with_settings(mlp_params)
        self.logreg = chosen["logreg"] if chosen else {"C": cfg.baselines.logreg_c}
        self.knn = chosen["knn"] if chosen else {"k": cfg.baselines.knn_k}
        if chosen:
            print("train-router: chosen by cross-validation: MLP " + ", ".join(f"{k}={v}" for k, v in chosen["mlp"].items())
                  + f"; logistic regression {self.logreg}; kNN {self.knn}")  # fmt: skip

    # ---- the MLP -------------------------------------------------------------------------------

    def fit(self) -> None:
        """The MLP on the training prompts' labels (and the served requests', ``served``), shrunk
        toward their domain's mean; the epoch is picked on the val prompts (without
        cross-validation). Leaves the trained router in ``self.router``."""
        table, fit_idx = self.table, self.fit_idx
        val = [] if self.cv else self.val_idx
        # The val prompts (epoch pick) are shrunk toward the training prompts' domain means.
        y = self.policies.y  # [P, D]
        fit_domains = [table.domains[i] for i in fit_idx]
        means = domain_means(y[fit_idx], fit_domains)
        y_fit = shrink_to_domain(y[fit_idx], fit_domains, self.shrink, means)  # [len(fit), D]
        y_val = shrink_to_domain(y[val], [table.domains[i] for i in val], self.shrink, means)  # [len(val), D]
        x_fit = self.x[fit_idx]  # [len(fit), F]
        if self.cfg.served:
            x_served, y_served = self._served()
            x_fit, y_fit = torch.cat([x_fit, x_served]), torch.cat([y_fit, y_served])
        with one_thread():
            state, self.history = fit_mlp(self.mlp_cfg, x_fit, y_fit, self.x[val], y_val)
        self.router = self._router(self.mlp_cfg, state)
        self.router.info["shrink"] = self.shrink
        if self.cv:
            self.router.info["selection"] = self.selection

    def _served(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Served requests' normalised features [S, F] and labels [S, D]: one measured drafter each
        (NaN elsewhere), shrunk toward the served rows' mean."""
        served = load_served(self.cfg.served, self.table, self.cfg.mode)
        m = torch.nanmean(served.acceptance, dim=0)  # [D]; NaN for a drafter no served request ran
        y = torch.where(torch.isnan(m), served.acceptance, (1 - self.shrink) * served.acceptance + self.shrink * m)  # [S, D]
        x = (self.featurizer(served.texts) - self.mean) / self.std  # [S, F]
        print(f"train-router: + {len(served.texts)} served prompts ({int((~torch.isnan(y)).sum())} measured entries)")
        return x, y

    # ---- evaluation ----------------------------------------------------------------------------

    def evaluate(self) -> dict:
        """The router, the baselines and the objective's rule fed the measured acceptance, scored
        on the held-out prompts (``routing.evaluate``); the scores also go into router.pt's ``info``."""
        table, router, fit_idx, test_idx = self.table, self.router, self.fit_idx, self.test_idx
        lengths = table.lengths(test_idx)
        choices = {"router (MLP)": [c.draft for c in router.decide(router.predict_from_features(self.raw[test_idx]), 1, lengths)]}
        choices["logistic regression"] = self.policies.logreg(self.logreg, fit_idx, test_idx)
        choices[f"knn (k={min(int(self.knn['k']), len(fit_idx))})"] = self.policies.knn(self.knn, fit_idx, test_idx)
        # The objective's rule fed the measured acceptance instead of a prediction: what a perfect
        # acceptance predictor would get, so the report separates prediction error from cost-model error.
        choices["hindsight acceptance"] = [c.draft for c in router.decide(table.acceptance[test_idx], 1, lengths)]

        report = score_policies(table, fit_idx, test_idx, router, choices)
        h = self.history
        report["mlp"] = {"best_epoch": h["best_epoch"], "final_train_loss": h["train_loss"][-1],
                         "best_val_loss": min(h["val_loss"]), "settings": dataclasses.asdict(self.mlp_cfg)}  # fmt: skip
        report["shrink"] = {"mlp": self.shrink, "logistic regression": self.policies.split(self.logreg)[1],
                            "knn": self.policies.split(self.knn)[1]}  # fmt: skip
        if self.selection is not None:
            report["selection"] = self.selection
        report["test_prompt_ids"] = [table.prompt_ids[i] for i in test_idx]
        report["test_data"] = list(self.cfg.test_data)
        router.info["eval"] = {name: {k: v for k, v in r.items() if not k.endswith("_by_domain")} for name, r in report["policies"].items()}
        self.report = report
        return report

    def save(self) -> None:
        """router.pt, eval.json, eval.md and eval.png under ``cfg.output``."""
        self.router.save(self.out / "router.pt")
        write_report(self.report, self.out)
        r, key = self.report["policies"], self.report["objective_metric"]
        print(f"train-router: {key} on held-out prompts: " + ", ".join(f"{n} {v[key]:.3f}" for n, v in r.items()))
        print(f"train-router: wrote {self.out / 'router.pt'}, eval.json, eval.md, eval.png")


def train(cfg: RouterTrainConfig) -> dict:
    """Train, evaluate and write router.pt, eval.json, eval.md and eval.png under cfg.output;
    returns the report (eval.json's contents)."""
    recipe = TrainRouterRecipe(cfg)
    recipe.setup()
    recipe.price()
    recipe.select()
    recipe.fit()
    report = recipe.evaluate()
    recipe.save()
    return report
