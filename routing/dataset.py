"""Collected rows -> one record per prompt: its text, domain and each draft's measured acceptance
and speedup (averaged over modes and repeats), the drafts' measured costs, and the split.

    table = load_table(["runs/router-data/rows.jsonl"], mode="greedy")
    table.acceptance   # [P, D] measured acceptance of each real draft
    train, val, test = split_prompts(table, test_fraction=0.25, val_fraction=0.15, seed=0)
    joined = join_tables(table, load_table(["runs/other/rows.jsonl"]))  # a separate test set
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from routing.cost_model import measured_fill, measured_fill_line
from routing.router import NONE
from routing.rows import read_rows


@dataclass
class Table:
    prompt_ids: list[str]
    texts: list[str]
    domains: list[str]
    drafts: list[str]  # real drafts, sorted; the MLP's outputs
    draft_refs: dict[str, str]
    target_ref: str
    has_none: bool  # the target alone was collected
    acceptance: torch.Tensor  # [P, D] measured acceptance rate
    speedup: torch.Tensor | None  # [P, D] measured speedup over the target alone (None without it)
    costs: dict[str, dict[str, float]]  # per draft: draft_cost, verify_cost (relative to a target step)
    k: int  # the K the data was collected with
    target_weights: str = "fp32"  # the target's precision in the collected rows (engine.target_weights)
    draft_weights: str | None = None  # the drafts' precision in them (engine.draft_weights resolved); None: not recorded
    splits: list[str | None] | None = None  # per prompt, the workload's fixed split (serving.workload), if any
    step_model: dict[str, float] | None = None  # target forward ms = base_ms + per_token_ms * tokens (batch 1)
    prompt_tokens: torch.Tensor | None = None  # [P] each prompt's length in the target's tokens (None: not recorded)
    prefill: dict | None = None  # the prefill model of routing.cost_model (``_prefill_model``); None: not measurable

    def lengths(self, idx: list[int]) -> torch.Tensor | None:
        """The prompts' lengths [len(idx)] for the router's rule, None where not recorded (a router
        without a prefill model or fill line prices them at nothing)."""
        return None if self.prompt_tokens is None else self.prompt_tokens[idx]


def read_collected(paths: list[str], mode: str = "greedy") -> list[dict]:
    """The rows of the collected files ``paths`` of one decoding ``mode`` ("all": every mode);
    a missing file is an error naming it."""
    rows = []
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"collected data {path} does not exist; run collect-router-data first")
        rows += read_rows(path)
    return rows if mode == "all" else [r for r in rows if r["mode"] == mode]


def load_table(paths: list[str], mode: str = "greedy") -> Table:
    rows = read_collected(paths, mode)
    if not rows:
        raise ValueError(f"no rows with mode={mode!r} in {paths}; set mode to one that was collected (or all)")
    targets = {r["target"] for r in rows}
    if len(targets) > 1:
        raise ValueError(f"the rows mix targets {sorted(targets)}: a router is for one target")
    precisions = {r.get("target_weights", "fp32") for r in rows}  # rows from before the setting: fp32
    if len(precisions) > 1:
        raise ValueError(f"the rows mix target precisions {sorted(precisions)}: acceptance and step costs differ "
                         "between them; train on rows collected with one engine.target_weights")  # fmt: skip
    draft_precisions = {r["draft_weights"] for r in rows if r["draft"] != NONE and r.get("draft_weights")}
    if len(draft_precisions) > 1:
        raise ValueError(f"the rows mix draft precisions {sorted(draft_precisions)}: draft costs and acceptance differ "
                         "between them; train on rows collected with one engine.draft_weights")  # fmt: skip
    drafts = sorted({r["draft"] for r in rows} - {NONE})
    if not drafts:
        raise ValueError(f"the rows hold no draft besides {NONE!r}")
    refs = {r["draft"]: r["draft_ref"] for r in rows if r["draft"] != NONE}
    has_none = any(r["draft"] == NONE for r in rows)

    by_prompt: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    info: dict[str, dict] = {}
    for r in rows:
        by_prompt[r["prompt_id"]][r["draft"]].append(r)
        info.setdefault(r["prompt_id"], r)
    # Only prompts measured with every draft can be scored against the oracle.
    need = set(drafts) | ({NONE} if has_none else set())
    ids = sorted(p for p, d in by_prompt.items() if need <= set(d))
    dropped = len(by_prompt) - len(ids)
    if dropped:
        print(f"train-router: {dropped} prompts lack some draft's rows and are left out")
    if not ids:
        raise ValueError("no prompt has rows for every draft")

    acc = torch.tensor([[_mean(by_prompt[p][d], "acceptance_rate") for d in drafts] for p in ids])  # [P, D]
    speed = None
    if has_none:
        speed = torch.tensor([[_mean(by_prompt[p][d], "speedup") for d in drafts] for p in ids])  # [P, D]
    return Table(
        prompt_ids=ids,
        texts=[info[p]["text"] for p in ids],
        domains=[info[p]["domain"] for p in ids],
        drafts=drafts,
        draft_refs=refs,
        target_ref=targets.pop(),
        has_none=has_none,
        acceptance=acc,
        speedup=speed,
        costs=_costs(rows, drafts, has_none),
        k=max(int(r["k"]) for r in rows),
        target_weights=precisions.pop(),
        draft_weights=draft_precisions.pop() if draft_precisions else None,
        splits=[info[p].get("split") for p in ids],
        step_model=_step_model(rows) if has_none else None,
        prompt_tokens=(torch.tensor([float(info[p]["prompt_tokens"]) for p in ids])
                       if all(info[p].get("prompt_tokens") for p in ids) else None),  # fmt: skip
        prefill=_prefill_model(rows, drafts) if has_none else None,
    )


def step_table(path: str | Path, target_weights: str | None = None) -> list[list[float]]:
    """[[rows, tokens per row, ms], ...] from a ``scripts/experiments/profile_step.py`` profile.json:
    the median of each step the target ran (``--batch-rows`` x ``--tokens``; the first forward
    path's; a (rows, tokens) measured twice averaged). Refuses, naming the file: one without steps of
    one row and of more, a row count without a 1-token step or a second width, a profile of a
    draft (``--as-draft``), or one of another precision than ``target_weights``."""
    path = Path(path)
    fix = "measure it with scripts/experiments/profile_step.py --batch-rows 1,4,8 --tokens 1,2,3,5,9"
    if not path.is_file():
        raise FileNotFoundError(f"step_profile {path} does not exist; {fix}")
    record = json.loads(path.read_text())
    if record.get("as_draft"):
        raise ValueError(f"step_profile {path} profiles a draft (--as-draft); {fix} on the target")
    if target_weights is not None and record.get("weights") not in (None, target_weights):
        raise ValueError(f"step_profile {path} was measured at weights={record['weights']}, the rows at "
                         f"target_weights={target_weights}; {fix} --weights {target_weights}")  # fmt: skip
    rows = [r for r in record.get("rows", []) if isinstance(r.get("tokens"), int)]
    if rows:
        first = rows[0]["path"]
        rows = [r for r in rows if r["path"] == first]
    measured: dict[tuple[float, float], list[float]] = defaultdict(list)
    for r in rows:
        measured[(float(r.get("batch_rows", 1)), float(r["tokens"]))].append(float(r["step_ms"]))
    counts = sorted({b for b, _ in measured})
    if 1.0 not in counts or len(counts) < 2:
        raise ValueError(f"step_profile {path} needs steps of one row and of more; {fix}")
    for b in counts:
        widths = {t for c, t in measured if c == b}
        if 1.0 not in widths or len(widths) < 2:
            raise ValueError(f"step_profile {path} needs a 1-token step and a wider one at {b:g} rows; {fix}")
    table, slowest = [], {}
    for (b, t), ms in sorted(measured.items()):
        # more tokens never cost less: a dip is the machine's noise, so each point is at least the one before
        slowest[b] = max(slowest.get(b, 0.0), statistics.fmean(ms))
        table.append([b, t, slowest[b]])
    return table


def _step_model(rows: list[dict]) -> dict[str, float] | None:
    """The target's forward cost as ``base_ms + per_token_ms * tokens`` at batch 1, from the
    medians of its one-token steps (the target alone) and of its K+1-token verifications (rows of
    model drafts, which always propose K); None when either is missing or the fit is not positive."""
    one = [r["target_step_ms"] for r in rows if r["draft"] == NONE and r.get("target_step_ms")]
    wide = [(r["target_step_ms"], int(r["k"])) for r in rows if r["draft"] != NONE and r.get("draft_step_ms")
            and r.get("target_step_ms") and int(r["k"]) > 0]  # fmt: skip
    if not one or not wide:
        return None
    t1 = statistics.median(one)
    t = statistics.median((ms - t1) / k for ms, k in wide)
    if t <= 0 or t1 - t <= 0:
        return None
    return {"base_ms": t1 - t, "per_token_ms": t}


def _line(xs: list[float], ys: list[float]) -> list[float] | None:
    """Least-squares [intercept, slope] of ys on xs; None with fewer than two distinct xs."""
    if len(set(xs)) < 2:
        return None
    slope, intercept = statistics.linear_regression(xs, ys)
    return [intercept, slope]


def _prefill_model(rows: list[dict], drafts: list[str]) -> dict | None:
    """The prefill model of ``routing.cost_model`` from collected rows, in target steps (each prompt's
    ``none`` row's ``target_step_ms``): the target's prefill against the prompt's length from the
    ``none`` rows, each drafter's own prefill on top (its row's ``prefill_ms`` minus the ``none``
    row's, which a drafting row also pays) the same way, and the answers' median length. None when
    the rows do not record prefill times and prompt lengths (collected before them)."""
    alone = {r["prompt_id"]: r for r in rows if r["draft"] == NONE and r.get("prefill_ms") is not None
             and r.get("prompt_tokens") and r.get("target_step_ms")}  # fmt: skip
    target = _line([float(r["prompt_tokens"]) for r in alone.values()],
                   [r["prefill_ms"] / r["target_step_ms"] for r in alone.values()])  # fmt: skip
    if target is None:
        return None
    lines = {}
    for d in drafts:
        mine = [r for r in rows if r["draft"] == d and r["prompt_id"] in alone and r.get("prefill_ms") is not None]
        line = _line([float(alone[r["prompt_id"]]["prompt_tokens"]) for r in mine],
                     [(r["prefill_ms"] - alone[r["prompt_id"]]["prefill_ms"]) / alone[r["prompt_id"]]["target_step_ms"]
                      for r in mine])  # fmt: skip
        lines[d] = line or [0.0, 0.0]
    answers = [float(r["new_tokens"]) for r in alone.values() if r.get("new_tokens")]
    if not answers:
        return None
    return {"target": target, "drafts": lines, "new_tokens": statistics.median(answers)}


@dataclass
class Served:
    """Served requests' rows: one measured drafter per prompt (the one the router chose)."""

    texts: list[str]
    acceptance: torch.Tensor  # [S, D] measured acceptance of the drafter that ran, NaN for the others


def load_served(paths: list[str], table: Table, mode: str = "greedy") -> Served:
    """The rows of serve's request logs, by prompt text, as entries of ``table``'s drafts (a row
    of a drafter the table lacks, or of the target alone, teaches nothing and is skipped)."""
    rows = []
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"request log {path} does not exist; serve with routing.log_requests={path} first")
        rows += read_rows(path)
    rows = [r for r in rows if (mode == "all" or r["mode"] == mode) and r["draft"] in table.drafts]
    for r in rows:
        if r.get("target_weights", "fp32") != table.target_weights or r["target"] != table.target_ref:
            raise ValueError(f"served row {r['prompt_id']} ran target {r['target']} at {r.get('target_weights', 'fp32')}; "
                             f"the collected rows {table.target_ref} at {table.target_weights}: serve and collect one target")  # fmt: skip
        if None not in (r.get("draft_weights"), table.draft_weights) and r["draft_weights"] != table.draft_weights:
            raise ValueError(f"served row {r['prompt_id']} ran its draft at draft_weights={r['draft_weights']}, the "
                             f"collected rows at {table.draft_weights}: serve with the engine.draft_weights collected")  # fmt: skip
    by_text: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_text[r["text"]][r["draft"]].append(float(r["acceptance_rate"]))
    texts = sorted(by_text)
    acc = torch.full((len(texts), len(table.drafts)), float("nan"))  # [S, D]
    for i, t in enumerate(texts):
        for j, d in enumerate(table.drafts):
            if by_text[t][d]:
                acc[i, j] = sum(by_text[t][d]) / len(by_text[t][d])
    return Served(texts, acc)


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else float("nan")


def _costs(rows: list[dict], drafts: list[str], has_none: bool) -> dict[str, dict[str, float]]:
    """Medians over all rows: c = draft step / target step; v = verification step / target step
    (1 when the target alone was not collected: then c is relative to the verification); and each
    draft's fill (``routing.cost_model.measured_fill``) where its rows record tokens per call."""
    step = defaultdict(list)
    for r in rows:
        step[(r["draft"], "draft")].append(r["draft_step_ms"])
        step[(r["draft"], "target")].append(r["target_step_ms"])
    costs = {}
    base = statistics.median(step[(NONE, "target")]) if has_none else None
    for d in drafts:
        draft_ms, verify_ms = statistics.median(step[(d, "draft")]), statistics.median(step[(d, "target")])
        ref = base or verify_ms
        costs[d] = {"draft_cost": draft_ms / ref, "verify_cost": verify_ms / ref if base else 1.0}
        # a row that made no target call (the answer ended at its prefill) says nothing about fill
        mine = [r for r in rows if r["draft"] == d and r.get("k") and r.get("target_calls")
                and r.get("mean_accepted_length") is not None and r["mean_accepted_length"] >= 1]  # fmt: skip
        if mine:  # mean_accepted_length: committed tokens per call, the bonus token included
            ks = {int(r["k"]) for r in mine}
            costs[d]["fill"] = measured_fill([float(r["acceptance_rate"]) for r in mine],
                                             [float(r["mean_accepted_length"]) - 1 for r in mine], max(ks))  # fmt: skip
            if all(r.get("prompt_tokens") for r in mine):
                line = measured_fill_line([float(r["acceptance_rate"]) for r in mine],
                                          [float(r["mean_accepted_length"]) - 1 for r in mine],
                                          [float(r["prompt_tokens"]) for r in mine], max(ks))  # fmt: skip
                if line is not None:
                    costs[d]["fill_line"] = line
    return costs


def second_k(paths: list[str], curve_paths: list[str], prompts: set[str], k: int, mode: str = "greedy") -> dict[str, dict]:
    """Each drafter's rows at one K other than the collected ``k`` (``curve_paths``) beside its rows
    at ``k`` (``paths``), on the prompts of ``prompts`` that both measured with a speedup:
    {drafter: {"k": K2, "prompts": [ids], "rates": acceptance at k [P], "speedups": measured at K2
    [P], "prompt_tokens": [P] or None}}."""
    def usable(path_list: list[str]) -> dict[tuple[str, str], dict]:
        return {(r["prompt_id"], r["draft"]): r for r in read_collected(path_list, mode)
                if r["draft"] != NONE and r["prompt_id"] in prompts}  # fmt: skip

    at_k, curve = usable(paths), usable(curve_paths)
    other = {int(r["k"]) for r in curve.values()}
    if k in other or len(other) > 1:
        raise ValueError(f"curve_data holds rows at K {sorted(other)}: give rows at one K other than the collected K = {k}")
    found = {}
    for d in sorted({d for _, d in curve}):
        both = sorted(p for (p, name) in curve if name == d and (p, d) in at_k and int(at_k[(p, d)]["k"]) == k
                      and curve[(p, d)].get("speedup") is not None)  # fmt: skip
        if not both:
            continue
        found[d] = {"k": int(curve[(both[0], d)]["k"]), "prompts": both,
                    "rates": torch.tensor([float(at_k[(p, d)]["acceptance_rate"]) for p in both]),
                    "speedups": torch.tensor([float(curve[(p, d)]["speedup"]) for p in both]),
                    "prompt_tokens": (torch.tensor([float(curve[(p, d)]["prompt_tokens"]) for p in both])
                                      if all(curve[(p, d)].get("prompt_tokens") for p in both) else None)}  # fmt: skip
    return found


def join_tables(first: Table, second: Table) -> Table:
    """``second``'s prompts appended after ``first``'s (whose indices stay as they were), for a test
    set collected apart from the training rows. Both must hold the same target, drafts (by name and
    reference), K and target-alone rows; the costs stay ``first``'s so that the test rows never
    shape the decision rule."""
    for name in ("target_ref", "drafts", "draft_refs", "has_none", "k", "target_weights"):
        a, b = getattr(first, name), getattr(second, name)
        if a != b:
            raise ValueError(f"the test rows were collected with {name}={b!r}, the training rows with {a!r}: "
                             "collect both with the same target, drafts and decode settings")  # fmt: skip
    if None not in (first.draft_weights, second.draft_weights) and first.draft_weights != second.draft_weights:
        raise ValueError(f"the test rows' drafts ran at draft_weights={second.draft_weights!r}, the training rows' at "
                         f"{first.draft_weights!r}: collect both with the same engine.draft_weights")  # fmt: skip
    both = sorted(set(first.prompt_ids) & set(second.prompt_ids))
    if both:
        raise ValueError(f"{len(both)} prompts (e.g. {both[0]!r}) are in both the training and the test rows: "
                         "a test prompt must be unseen; collect the test set from other rows (sources' offset)")  # fmt: skip
    return dataclasses.replace(
        first,
        prompt_ids=first.prompt_ids + second.prompt_ids,
        texts=first.texts + second.texts,
        domains=first.domains + second.domains,
        acceptance=torch.cat([first.acceptance, second.acceptance]),  # [P1 + P2, D]
        speedup=None if first.speedup is None else torch.cat([first.speedup, second.speedup]),
        prompt_tokens=(None if first.prompt_tokens is None or second.prompt_tokens is None
                       else torch.cat([first.prompt_tokens, second.prompt_tokens])),  # fmt: skip
        splits=(first.splits or [None] * len(first.prompt_ids)) + (second.splits or [None] * len(second.prompt_ids)),
    )


def split_prompts(table: Table, test_fraction: float, val_fraction: float, seed: int) -> tuple[list[int], list[int], list[int]]:
    """Deterministic split by prompt, stratified by domain: (train, val, test) row indices.
    Depends only on the prompt ids and the seed, so the same data gives the same split.
    ``test_fraction=0`` keeps no test prompts (the test set comes from elsewhere)."""
    train, val, test = [], [], []
    for domain in sorted(set(table.domains)):
        idx = sorted((i for i, d in enumerate(table.domains) if d == domain), key=lambda i: table.prompt_ids[i])
        random.Random(f"{seed}/{domain}").shuffle(idx)
        n_test = max(1, round(test_fraction * len(idx))) if len(idx) > 2 and test_fraction > 0 else 0
        rest = idx[n_test:]
        n_val = max(1, round(val_fraction * len(rest))) if len(rest) > 2 else 0
        test += idx[:n_test]
        val += rest[:n_val]
        train += rest[n_val:]
    if (test_fraction > 0 and not test) or not train:
        raise ValueError(f"{len(table.prompt_ids)} prompts are too few to split into train and test")
    return sorted(train), sorted(val), sorted(test)


def finite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))
