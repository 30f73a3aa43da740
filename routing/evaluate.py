"""Held-out evaluation of routing policies and the report (JSON, markdown, PNG).

Every policy is a weight matrix [N, O] over the options (the real drafts, then "none"): one-hot
for a policy that picks, uniform for the random one (its expected value, no sampling noise).
Each is scored on the same measured values [N, O]:

* acceptance: the chosen draft's measured acceptance rate (none: 0);
* model_speedup: the cost model's speedup at the best K from the measured acceptance (none: 1);
* measured_speedup: the chosen draft's measured tokens/s over the target alone's (none: 1),
  when the target alone was collected.

The objective's metric (acceptance, or speedup: measured if collected else the model's) defines
the oracle, the best single draft (best mean on the training prompts) and the regret. Each policy's
lead over the best single draft comes with its paired standard error over the held-out prompts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from routing.dataset import Table
from routing.router import NONE, Router

METRICS = ("acceptance", "model_speedup", "measured_speedup")


def options(table: Table, router: Router) -> list[str]:
    """What a policy may choose: the drafts, plus the target alone where the objective allows it."""
    return table.drafts + ([NONE] if router.objective == "speedup" else [])


def metric_values(table: Table, idx: list[int], router: Router) -> dict[str, torch.Tensor]:
    """Measured value [N, O] of each option for every metric."""
    opts = options(table, router)
    acc = table.acceptance[idx]  # [N, D]
    model, _ = router.cost_model.speedups(acc, 1, table.lengths(idx))  # [N, D]
    extra = len(opts) - len(table.drafts)  # the "none" column, if any
    values = {
        "acceptance": torch.cat([acc, torch.zeros(len(idx), extra)], 1),
        "model_speedup": torch.cat([model, torch.ones(len(idx), extra)], 1),
    }
    if table.speedup is not None:
        values["measured_speedup"] = torch.cat([table.speedup[idx], torch.ones(len(idx), extra)], 1)
    return values


def objective_metric(table: Table, objective: str) -> str:
    if objective == "acceptance":
        return "acceptance"
    return "measured_speedup" if table.speedup is not None else "model_speedup"


def one_hot(choices: list[str], opts: list[str]) -> torch.Tensor:
    w = torch.zeros(len(choices), len(opts))
    for i, c in enumerate(choices):
        w[i, opts.index(c)] = 1.0
    return w


def score(weights: torch.Tensor, values: dict[str, torch.Tensor], domains: list[str]) -> dict:
    """Mean of each metric under a policy's weights, overall and per domain."""
    out: dict = {}
    for name, v in values.items():
        per_prompt = (weights * v).sum(1)  # [N]
        out[name] = float(per_prompt.mean())
        out[f"{name}_by_domain"] = {
            d: float(per_prompt[[i for i, x in enumerate(domains) if x == d]].mean()) for d in sorted(set(domains))
        }
    return out


def confusion(chosen: list[str], best: list[str], opts: list[str]) -> list[list[int]]:
    """counts[i][j]: prompts where the policy chose opts[i] and the oracle's best was opts[j]."""
    counts = [[0] * len(opts) for _ in opts]
    for c, b in zip(chosen, best):
        counts[opts.index(c)][opts.index(b)] += 1
    return counts


def chosen_by_domain(chosen: list[str], domains: list[str], opts: list[str]) -> dict[str, dict[str, int]]:
    """{domain: {option: prompts of that domain the policy sent to it}}: where a policy routes."""
    return {d: {o: sum(c == o for c, x in zip(chosen, domains) if x == d) for o in opts} for d in sorted(set(domains))}


def evaluate(
    table: Table, train_idx: list[int], test_idx: list[int], router: Router, policies: dict[str, list[str]]
) -> dict:
    """Score the oracle, the best single draft, random and ``policies`` (name -> choice per test
    prompt) on the held-out prompts."""
    opts = options(table, router)
    key = objective_metric(table, router.objective)
    test_values = metric_values(table, test_idx, router)
    train_values = metric_values(table, train_idx, router)
    best_per_prompt = [opts[j] for j in test_values[key].argmax(1).tolist()]
    single = opts[int(train_values[key].mean(0).argmax())]
    domains = [table.domains[i] for i in test_idx]
    n = len(test_idx)
    weights = {
        "oracle": one_hot(best_per_prompt, opts),
        f"best single ({single})": one_hot([single] * n, opts),
        "random": torch.full((n, len(opts)), 1.0 / len(opts)),
        **{name: one_hot(choices, opts) for name, choices in policies.items()},
    }
    results = {name: score(w, test_values, domains) for name, w in weights.items()}
    oracle = results["oracle"][key]
    single_per_prompt = test_values[key][:, opts.index(single)]  # [N]
    for name, r in results.items():
        r["regret"] = oracle - r[key]
        r["fraction_of_oracle"] = r[key] / oracle if oracle else float("nan")
        # Paired over the same prompts, so that what all policies share (easy and hard prompts)
        # cancels: the standard error says whether a lead over the best single draft is noise.
        diff = (weights[name] * test_values[key]).sum(1) - single_per_prompt  # [N]
        se = float(diff.std(unbiased=True) / n**0.5) if n > 1 else float("nan")
        r["vs_best_single"] = {"mean": float(diff.mean()), "se": se}
    return {
        "objective": router.objective,
        "objective_metric": key,
        "options": opts,
        "best_single": single,
        "n_train": len(train_idx),
        "n_test": n,
        "test_domains": {d: domains.count(d) for d in sorted(set(domains))},
        "policies": results,
        "confusion": {name: confusion(choices, best_per_prompt, opts) for name, choices in policies.items()},
        "chosen_by_domain": {name: chosen_by_domain(choices, domains, opts) for name, choices in policies.items()},
        "costs": router.costs,
        "collected": collected_summary(table),
    }


def collected_summary(table: Table) -> dict:
    """Every collected prompt, not just the held-out ones: per domain and draft, the mean measured
    acceptance and speedup and how many prompts ran slower than the target alone."""
    out: dict = {}
    for domain in sorted(set(table.domains)):
        idx = [i for i, d in enumerate(table.domains) if d == domain]
        out[domain] = {"prompts": len(idx)}
        for j, draft in enumerate(table.drafts):
            entry = {"acceptance": float(table.acceptance[idx, j].mean())}
            if table.speedup is not None:
                speed = table.speedup[idx, j]  # [n]
                entry |= {"speedup": float(speed.mean()), "slower_than_target": int((speed < 1).sum())}
            out[domain][draft] = entry
    return out


# ---- report ----------------------------------------------------------------------------------


def write_report(report: dict, out_dir: Path) -> None:
    """eval.json, eval.md and eval.png in ``out_dir`` (each written atomically)."""
    _atomic_text(out_dir / "eval.json", json.dumps(report, indent=2))
    _atomic_text(out_dir / "eval.md", markdown(report))
    plot(report, out_dir / "eval.png")


def markdown(report: dict) -> str:
    metrics = [m for m in METRICS if m in next(iter(report["policies"].values()))]
    source = f" from {', '.join(report['test_data'])}" if report.get("test_data") else ""
    lines = [
        f"# Router evaluation ({report['n_test']} held-out prompts{source}, {report['n_train']} training)",
        "",
        f"Objective: **{report['objective']}** (scored by `{report['objective_metric']}`); "
        f"held-out prompts per domain: {report['test_domains']}."
        + (" Labels shrunk toward their domain's mean by " + ", ".join(f"{k} {v:g}" for k, v in report["shrink"].items()) + "."
           if report.get("shrink") else ""),
        "",
        "| policy | " + " | ".join(metrics) + " | regret | % of oracle | vs best single (± paired SE) |",
        "|---|" + "---:|" * (len(metrics) + 3),
    ]
    for name, r in report["policies"].items():
        vs = r["vs_best_single"]
        cells = [f"{r[m]:.3f}" for m in metrics] + [f"{r['regret']:.3f}", f"{100 * r['fraction_of_oracle']:.1f}",
                                                    f"{vs['mean']:+.3f} ± {vs['se']:.3f}"]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    domains = sorted(report["test_domains"])
    lines += ["", f"Per domain ({report['objective_metric']}):", "", "| policy | " + " | ".join(domains) + " |",
              "|---|" + "---:|" * len(domains)]  # fmt: skip
    for name, r in report["policies"].items():
        by = r[f"{report['objective_metric']}_by_domain"]
        lines.append(f"| {name} | " + " | ".join(f"{by[d]:.3f}" for d in domains) + " |")
    opts = report["options"]
    for name, counts in report["confusion"].items():
        lines += ["", f"Confusion of `{name}`: rows = chosen, columns = best in hindsight", "",
                  "| chosen \\ best | " + " | ".join(opts) + " |", "|---|" + "---:|" * len(opts)]  # fmt: skip
        lines += [f"| {o} | " + " | ".join(map(str, row)) + " |" for o, row in zip(opts, counts)]
        by = report["chosen_by_domain"][name]
        lines += ["", f"Chosen by `{name}` per domain: " + "; ".join(
            f"{d}: " + ", ".join(f"{o} {by[d][o]}" for o in opts if by[d][o]) for d in domains)]  # fmt: skip
    selection = report.get("selection")
    if selection:
        lines += ["", f"Settings chosen by cross-validation on the training prompts (mean held-out `{report['objective_metric']}` "
                  "of each candidate's choices; best first, at most five):", ""]  # fmt: skip
        for family, sel in selection.items():
            ranked = sorted(sel["candidates"], key=lambda c: -c["score"])[:5]
            lines.append(f"- {family}: " + "; ".join(
                ", ".join(f"{k}={v:g}" for k, v in c["params"].items()) + f" -> {c['score']:.3f}" for c in ranked))  # fmt: skip
    lines += ["", "Costs per draft (relative to one target step; c: draft step, v: the rest of a call, fitted to "
              "the measured speedups when a verify step is shown beside it; fill: the share of the drafted slots "
              "the geometric model assumes that its calls filled): " + ", ".join(
        f"{d}: c={c['draft_cost']:.3f}, v={c['verify_cost']:.3f}"
        + (f" (verify step {c['verify_step_cost']:.3f})" if "verify_step_cost" in c else "")
        + (f", fill={c['fill']:.2f}" if "fill" in c else "")
        for d, c in report["costs"].items())]  # fmt: skip
    collected = report.get("collected") or {}
    if collected:
        lines += ["", "All collected prompts (training and held-out), per domain and draft: mean acceptance, mean measured "
                  "speedup over the target alone, prompts slower than it:", "",
                  "| domain | prompts | draft | acceptance | speedup | slower than target |", "|---|---:|---|---:|---:|---:|"]  # fmt: skip
        for domain, per in collected.items():
            for draft, e in per.items():
                if draft == "prompts":
                    continue
                speed = f"{e['speedup']:.3f} | {e['slower_than_target']}" if "speedup" in e else "- | -"
                lines.append(f"| {domain} | {per['prompts']} | {draft} | {e['acceptance']:.3f} | {speed} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in METRICS if m in next(iter(report["policies"].values()))]
    names = list(report["policies"])
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 4), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        values = [report["policies"][n][m] for n in names]
        ax.bar(range(len(names)), values, color=["#888" if n == "oracle" else "#4a7" for n in names])
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(m.replace("_", " "))
        if "speedup" in m:
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
    fig.suptitle(f"router on {report['n_test']} held-out prompts (objective: {report['objective']})")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
