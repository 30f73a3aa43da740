"""Routed decoding on the six-family workload, measured live: the report's workload section.

    report = measure({"routed": Router.load("runs/workload/router/router.pt")}, load_workload("test", 5),
                     max_new_tokens=48, settings=EngineSettings(target_weights="int8", request_k_max=8))
    print(markdown(report)); plot(report, "runs/report/workload.png")

One engine holds the target, the router's drafts, ``ngram``, ``suffix`` and ``none``, and each
routed policy has model-free drafters of its own (``suffix`` caches answers: shared, it would hand
one policy the answer another policy just produced for the same prompt). For every
prompt of the split it runs, in an order that rotates from prompt to prompt (so machine drift hits
every policy alike): the target alone, each single drafter at the engine's fixed K, and the routed
policy of each router given (its drafter and K for a batch of one, with the serving fallback rule). Tokens/s
is a request's tokens over its wall time, prefill included. Per prompt the oracle is the fastest
of the target alone and the single drafters; the best single drafter is the one with the highest
mean speedup over all the split's prompts (chosen with hindsight: a generous comparison for the
router). Every greedy output is checked against the target alone's.

Repeats: one run of 48 tokens is a few seconds, and on a shared machine the same request measured
twice can differ by a fifth or more (docs/experiments/router-workload.md). With ``repeats`` R > 1
every prompt runs every policy R times (the order rotating between rounds) and a policy's tokens/s
is its median. The oracle, the fastest policy per prompt, then still profits from what noise is left
(the maximum of several noisy numbers is biased upwards), so the summary also gives the
**held-out oracle**: each round's fastest policy chosen on the other rounds' runs and timed on this
round's, which a policy that knew each prompt's true best would match. And the **family ceiling**:
every prompt run with its family's best single policy (hindsight per family), what a router that
knew each prompt's family and nothing finer could reach.

Model-free drafters hold state across requests (``suffix`` caches answers), so each round runs them
as fresh instances of their own: a second round must not find the answer of the first.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from routing.router import NONE, Router
from routing.router_file import read_router_file
from serving.engine import Request
from serving.engine.request import Fallback
from serving.engine.engine_settings import EngineSettings, HOST_DRAFTERS
from serving.engine.loader import load_engine
from serving.prompts import Prompt, encode_prompt

ROUTED = "routed"


def trained_precisions(router_path: str | Path) -> tuple[str, str]:
    """(target_weights, draft_weights) of the rows the router at ``router_path`` was trained on,
    read without loading its embedder: what its workload runs serve and measure at. Routers from
    before the fields were trained on the int8 workload's rows with drafts at ``auto``."""
    info = read_router_file(router_path)["info"]
    return info.get("target_weights") or "int8", info.get("draft_weights") or "auto"


def measure(routers: dict[str, Router], prompts: list[Prompt], *, max_new_tokens: int, settings: EngineSettings,
            fallback_ratio: float | None = 0.75, singles: bool = True, extra_k: Sequence[int] = (),
            repeats: int = 1) -> dict:  # fmt: skip
    """Measure the target alone, every single drafter (unless ``singles`` is false) and each
    router's routed policy (named by its key) on every prompt. ``extra_k``: each single drafter
    also at these fixed K (policies ``NAME@K``; ``settings.request_k_max`` must allow them), so
    that a routed policy's K choice is measured against single drafters that fix a longer K too.
    ``repeats``: runs of every policy per prompt, each policy's tokens/s their median."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: give at least 1 run per policy and prompt")
    targets = {r.target_ref for r in routers.values()}
    if len(targets) != 1:
        raise ValueError(f"the routers name different targets {sorted(targets)}: compare routers of one target")
    drafts: dict[str, str] = {}
    for r in routers.values():
        drafts |= {n: ref for n, ref in r.draft_refs.items() if n != NONE}
    drafts |= {h: h for h in HOST_DRAFTERS if h not in drafts}
    limit = settings.request_k_max or settings.k  # what a request may set for itself
    bad = [k for k in extra_k if not 1 <= k <= limit]
    if bad:
        raise ValueError(f"extra_k={list(extra_k)}: {bad} outside 1..{limit} (request_k_max={settings.request_k_max}); "
                         "raise request_k_max or drop them")
    at_k, own = own_drafters(drafts, list(routers), extra_k, settings.k)
    # Model-free instances, shared ones included, as each round names them (round 0: their own names).
    instances = {**{d: ref for d, ref in drafts.items() if ref in HOST_DRAFTERS}, **own}
    rounds = {round_name(n, r, instances): kind for r in range(1, repeats) for n, kind in instances.items()}
    single = [*drafts, *at_k, NONE] if singles else [NONE]
    loaded = load_engine(settings, targets.pop(), drafts | own | rounds | {NONE: None})
    engine, tokenizer = loaded.engine, loaded.tokenizer
    warm = tokenizer.encode("def add(a, b):", add_special_tokens=False)
    for name in [*drafts, *own, *rounds, NONE]:  # first-use costs of every drafter paid before the clock runs
        engine.generate([Request(warm, max_new_tokens=4, drafter=name)])
    policies = [*single, *routers]
    rows = []
    for i, prompt in enumerate(tqdm(prompts, desc="workload", unit="prompt")):
        ids = encode_prompt(tokenizer, prompt)
        choices = {name: r.choose(prompt.text, prompt_tokens=len(ids)) for name, r in routers.items()}
        row = {"id": prompt.id, "family": prompt.domain, "choice": {n: c.draft for n, c in choices.items()},
               "k": {n: c.k for n, c in choices.items()}, "tokens_per_s": {}, "runs": {n: [] for n in policies},
               "acceptance": {}, "fallback": {}}  # fmt: skip
        outputs: dict[str, list[list[int]]] = {n: [] for n in policies}
        for r in range(repeats):
            for j in range(len(policies)):
                name = policies[(i + j + r) % len(policies)]
                if name in choices:
                    c = choices[name]
                    floor = c.fallback_floor(fallback_ratio) if fallback_ratio is not None else 0.0
                    drafter = f"{name}/{c.draft}" if c.draft in HOST_DRAFTERS else c.draft
                    request = Request(ids, max_new_tokens=max_new_tokens, drafter=round_name(drafter, r, instances),
                                      k=c.k if c.draft != NONE else None, fallback=Fallback(floor) if floor > 0 else None)  # fmt: skip
                elif name in at_k:
                    request = Request(ids, max_new_tokens=max_new_tokens, drafter=round_name(at_k[name][0], r, instances),
                                      k=at_k[name][1])  # fmt: skip
                else:
                    request = Request(ids, max_new_tokens=max_new_tokens, drafter=round_name(name, r, instances))
                started = time.perf_counter()
                [out] = engine.generate([request])
                elapsed = time.perf_counter() - started
                outputs[name].append(out.token_ids)
                row["runs"][name].append(len(out.token_ids) / elapsed)
                if r == 0:
                    row["acceptance"][name] = out.stats["acceptance_rate"]
                    if name in choices:
                        row["fallback"][name] = out.stats.get("fallback")
        row["tokens_per_s"] = {n: statistics.median(row["runs"][n]) for n in policies}
        row["identical"] = {n: all(o == outputs[NONE][0] for o in outputs[n]) for n in policies if n != NONE}
        rows.append(row)
    return {"config": {"max_new_tokens": max_new_tokens, "k": settings.k, "extra_k": list(extra_k), "repeats": repeats,
                       "target_weights": settings.target_weights,
                       "draft_weights": settings.drafts_weights(),
                       "fallback_ratio": fallback_ratio, "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                       "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])},
            "policies": policies, "routed": list(routers), "rows": rows,
            "summary": summarize(rows, single, list(routers))}  # fmt: skip


def own_drafters(drafts: dict[str, str], routed: list[str], extra_k: Sequence[int], k: int
                 ) -> tuple[dict[str, tuple[str, int]], dict[str, str]]:  # fmt: skip
    """The ``NAME@K`` single policies, policy -> (the engine drafter it runs, K), and the model-free
    drafters each policy owns, engine name -> kind. Every policy that drafts with a model-free drafter
    gets its own instance: a ``suffix`` cache shared between policies would hold this very prompt's
    answer from the policy that ran it first, and that policy would look far faster than it is."""
    at_k = {f"{d}@{kk}": (f"{d}@{kk}" if ref in HOST_DRAFTERS else d, kk)
            for kk in extra_k if kk != k for d, ref in drafts.items()}  # fmt: skip
    own = {f"{name}/{h}": h for name in routed for h in HOST_DRAFTERS}
    own |= {name: drafts[name.partition("@")[0]] for name, (drafter, _) in at_k.items() if drafter == name}
    return at_k, own


def round_name(drafter: str, r: int, instances: dict[str, str]) -> str:
    """The engine drafter a policy drafting with ``drafter`` uses in round ``r``: a model-free
    instance (a name of ``instances``) is fresh each round, ``NAME#r``; a draft model and the
    target alone are the same every round."""
    if r == 0 or drafter not in instances:
        return drafter
    return f"{drafter}#{r}"


def held_out_oracle(row: dict, singles: list[str]) -> float | None:
    """One prompt's held-out oracle speedup: for each round r, the single policy fastest by its
    median over the other rounds, timed by its round-r run; the median of those over the rounds,
    over the target alone's median. None with fewer than two rounds."""
    runs, none = row.get("runs") or {}, row["tokens_per_s"][NONE]
    n = min((len(runs.get(p, [])) for p in singles), default=0)
    if n < 2:
        return None
    timed = []
    for r in range(n):
        best = max(singles, key=lambda p: statistics.median(runs[p][:r] + runs[p][r + 1 :]))
        timed.append(runs[best][r])
    return statistics.median(timed) / none


def summarize(rows: list[dict], singles: list[str], routed: list[str]) -> dict:
    """Per family and overall: each policy's mean speedup over the target alone, the oracle's
    (fastest single policy per prompt), the best single drafter (hindsight over all rows) and each
    routed policy against both."""

    def speedups(rs: list[dict], name: str) -> list[float]:
        return [r["tokens_per_s"][name] / r["tokens_per_s"][NONE] for r in rs]

    best_single = max(singles, key=lambda n: statistics.fmean(speedups(rows, n)))
    families = list(dict.fromkeys(r["family"] for r in rows))
    family_best = {f: max(singles, key=lambda n: statistics.fmean(speedups([r for r in rows if r["family"] == f], n)))
                   for f in families}  # fmt: skip
    out = {}
    for group in [*families, "all"]:
        rs = rows if group == "all" else [r for r in rows if r["family"] == group]
        mean = {n: statistics.fmean(speedups(rs, n)) for n in [*singles, *routed]}
        oracle = statistics.fmean(max(r["tokens_per_s"][n] for n in singles) / r["tokens_per_s"][NONE] for r in rs)
        held = [held_out_oracle(r, singles) for r in rs]
        held_out = statistics.fmean(held) if all(h is not None for h in held) else None
        ceiling = statistics.fmean(r["tokens_per_s"][family_best[r["family"]]] / r["tokens_per_s"][NONE] for r in rs)
        choices = {n: {} for n in routed}
        for r in rs:
            for n in routed:
                choices[n][r["choice"][n]] = choices[n].get(r["choice"][n], 0) + 1
        out[group] = {
            "prompts": len(rs), "speedup": mean, "oracle": oracle, "best_single": best_single,
            "oracle_held_out": held_out, "family_ceiling": ceiling,
            "family_best": {f: family_best[f] for f in families if group in ("all", f)},
            "vs_best_single": {n: mean[n] / mean[best_single] for n in routed},
            "vs_oracle": {n: mean[n] / oracle for n in routed},
            "vs_oracle_held_out": {n: mean[n] / held_out if held_out else None for n in routed}, "choices": choices,
            "identical": sum(all(r["identical"].values()) for r in rs),
            "fallbacks": {n: sum(r["fallback"].get(n) is not None for r in rs) for n in routed},
        }  # fmt: skip
    return out


def markdown(report: dict) -> str:
    c, s = report["config"], report["summary"]
    routed = report["routed"]
    singles = [p for p in report["policies"] if p not in routed]
    best = s["all"]["best_single"]
    held = s["all"].get("oracle_held_out") is not None
    repeats = c.get("repeats", 1)
    ks = " and ".join(str(k) for k in dict.fromkeys([c["k"], *c.get("extra_k", [])]))
    per_family = ", ".join(f"{f} `{p}`" for f, p in s["all"].get("family_best", {}).items())
    lines = [f"{c['max_new_tokens']} new tokens, greedy, single drafters at K = {ks} (`NAME@K`), target {c['target_weights']}, "
             f"drafts {c.get('draft_weights', 'int8')}; "
             + (f"each policy run {repeats} times per prompt (rounds in rotating order), its tokens/s the median; " if repeats > 1 else "")
             + "speedup = tokens/s over the target alone on the same prompt, prefill included; oracle = the fastest single "
             f"policy per prompt; best single drafter (hindsight, all prompts): `{best}`"
             + ("; held-out oracle = each round's fastest policy chosen on the other rounds" if held else "")
             + (f"; family ceiling = each family's best single policy (hindsight: {per_family})." if per_family else "."), "",
             "| family | prompts | " + " | ".join(singles + routed) + " | oracle | "
             + ("oracle (held out) | " if held else "") + ("family ceiling | " if per_family else "")
             + " | ".join(f"{n} / best single | {n} / oracle | " + (f"{n} / held-out oracle | " if held else "")
                          + f"{n}'s choices" for n in routed) + " | identical |"]  # fmt: skip
    lines.append("|" + "---|" * (lines[-1].count("|") - 1))
    for group, g in s.items():
        cells = [f"{g['speedup'][n]:.2f}x" for n in singles + routed] + [f"{g['oracle']:.2f}x"]
        cells += [f"{g['oracle_held_out']:.2f}x"] if held else []
        cells += [f"{g['family_ceiling']:.2f}x"] if per_family else []
        for n in routed:
            picks = ", ".join(f"{d} {k}" for d, k in sorted(g["choices"][n].items()))
            cells += [f"{g['vs_best_single'][n]:.2f}", f"{g['vs_oracle'][n]:.2f}"]
            cells += [f"{g['vs_oracle_held_out'][n]:.2f}"] if held else []
            cells += [picks]
        lines.append(f"| {group} | {g['prompts']} | " + " | ".join(cells) + f" | {g['identical']}/{g['prompts']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    groups = list(s)
    extra = {"oracle": "oracle"} | ({"oracle (held out)": "oracle_held_out"} if s["all"].get("oracle_held_out") else {})
    names = [*report["policies"], *extra]
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(groups)), 4))
    for j, n in enumerate(names):
        vals = [s[g][extra[n]] if n in extra else s[g]["speedup"][n] for g in groups]
        ax.bar([i + j * width for i in range(len(groups))], vals, width, label=n)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups)
    ax.set_ylabel("speedup over the target alone")
    ax.set_title(f"Workload ({report['config'].get('split', '')} split): single drafters, routed, oracle")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(report: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)

