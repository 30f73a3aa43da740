"""Deployment profiles: what Choral measured, in the form the simulator (``simulate``) consumes.

A profile holds measurements only; the scenario (how many clients, which hardware, which
policies) lives in the simulator's config. Sections:

* ``target``: cost of one target forward as a linear model of the batch it runs,
  ``ms = base_ms + per_row_ms * rows + per_token_ms * step_tokens + prefill_per_token_ms * prompt_tokens``
  (``step_tokens``: the K+1 tokens of every verifying row together), fitted to the measured
  ``points`` it keeps for reference (:meth:`CostModel.fit`).
* ``drafts``: per draft, the same cost model for one draft forward on the measuring machine, and
  the acceptance per domain: ``acceptance[domain][i]`` is the probability that draft position ``i``
  is accepted (unconditional, as ``RequestStats.per_position_acceptance`` reports it, so it never
  increases with ``i``); the key ``all`` serves domains without their own curve. ``proposes``
  (optional) is the fraction of steps on which a model-free drafter proposes anything: the
  simulator runs the others as plain one-token steps (vLLM's ``ngram`` without a match).
* ``domains``: per domain, its share of the traffic and its prompt and output length distributions.
* ``network``: measured links by name (e.g. ``loopback`` from the server's load test).
* ``meta``: free-form provenance (source file, command, machine, models).

Builders read Choral's own measurements: :func:`from_bench` (``spec-bench``'s ``bench.json``),
:func:`from_router_data` (``collect-router-data`` JSONL rows) and :func:`from_load_test` (the
server's load test result; fields documented there). Each takes an optional ``base`` profile whose
sections fill whatever the measurement lacks. Files are YAML or JSON (by extension), loaded with
the same checks as configs: an unknown key or a bad value is a ``ConfigError`` naming it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from serving.config import ConfigError, load_config, to_dict

PROFILE_VERSION = 1


def doc(text: str) -> dict:
    return {"doc": text}


@dataclass
class CostPoint:
    rows: int = field(metadata=doc("rows (sequences) in the forward"))
    tokens_per_row: float = field(metadata=doc("tokens each row feeds: K+1 when verifying, 1 for a plain step, the prompt for a prefill"))
    ms: float = field(metadata=doc("measured wall time of the forward"))
    kind: Literal["step", "prefill"] = "step"

    def __post_init__(self) -> None:
        if self.rows < 1 or self.tokens_per_row <= 0 or self.ms <= 0:
            raise ValueError(f"cost point {self.rows} rows x {self.tokens_per_row} tokens, {self.ms} ms must be positive")


@dataclass
class CostModel:
    base_ms: float = field(metadata=doc("fixed cost of a forward (weights streamed once, launch overhead)"))
    per_token_ms: float = field(default=0.0, metadata=doc("cost of each step token over all rows"))
    per_row_ms: float = field(default=0.0, metadata=doc("cost of each row (attention over its cache, sampling)"))
    prefill_per_token_ms: float = field(default=0.0, metadata=doc("cost of each prompt token prefilled"))
    points: list[CostPoint] = field(default_factory=list, metadata=doc("measurements the coefficients were fitted to"))

    def __post_init__(self) -> None:
        for name in ("base_ms", "per_token_ms", "per_row_ms", "prefill_per_token_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")

    def ms(self, rows: int, step_tokens: float, prefill_tokens: float = 0.0) -> float:
        """Milliseconds of one forward over ``rows`` rows feeding ``step_tokens`` decode/verify
        tokens and ``prefill_tokens`` prompt tokens in total."""
        return self.base_ms + self.per_row_ms * rows + self.per_token_ms * step_tokens + self.prefill_per_token_ms * prefill_tokens

    @classmethod
    def fit(cls, points: list[CostPoint]) -> CostModel:
        """Least squares with non-negative coefficients. A coefficient the points cannot tell
        apart from the others (all points with one row, or one width) is left at 0 and its cost
        lands in the ones that remain; prefill points fit only ``prefill_per_token_ms``."""
        steps = [p for p in points if p.kind == "step"]
        if not steps:
            raise ValueError("a cost model needs at least one measured step (kind: step)")
        cols = ["base_ms", "per_row_ms", "per_token_ms"]
        feats = {"base_ms": lambda p: 1.0, "per_row_ms": lambda p: p.rows, "per_token_ms": lambda p: p.rows * p.tokens_per_row}
        best: tuple[float, dict[str, float]] | None = None
        # Every subset of the columns the points can tell apart (full rank), keeping the best fit
        # whose coefficients are all >= 0: an exact non-negative least squares for three unknowns.
        for n in range(1, len(cols) + 1):
            for subset in itertools.combinations(cols, n):
                coef = _lstsq([[feats[c](p) for c in subset] for p in steps], [p.ms for p in steps])
                if coef is None or min(coef) < 0:
                    continue
                sol = dict(zip(subset, coef))
                err = sum((p.ms - sum(sol[c] * feats[c](p) for c in subset)) ** 2 for p in steps)
                if best is None or err < best[0] - 1e-9:
                    best = (err, sol)
        sol = best[1] if best else {"base_ms": min(p.ms for p in steps)}
        model = cls(**{k: float(v) for k, v in sol.items()}, points=list(points))
        pre = [p for p in points if p.kind == "prefill"]
        if pre:
            # Through the step model's fixed cost: what is left per prompt token.
            num = sum((p.ms - model.ms(p.rows, 0)) * p.rows * p.tokens_per_row for p in pre)
            den = sum((p.rows * p.tokens_per_row) ** 2 for p in pre)
            model.prefill_per_token_ms = max(0.0, num / den)
        return model

    def fit_error(self) -> float:
        """Relative RMS error of the model on its own points (0 when it has none)."""
        if not self.points:
            return 0.0
        errs = [
            (self.ms(p.rows, p.rows * p.tokens_per_row if p.kind == "step" else 0, p.rows * p.tokens_per_row if p.kind == "prefill" else 0) - p.ms) / p.ms
            for p in self.points
        ]
        return math.sqrt(sum(e * e for e in errs) / len(errs))


def step_ms(target: CostModel, draft: CostModel | None, k: int, rows: int, propose_rate: float = 1.0,
            draft_speed: float = 1.0) -> float:
    """Milliseconds of one speculative step of ``rows`` rows that draft up to ``k`` tokens each: K
    draft forwards over the rows when any row proposes (a row proposes with ``propose_rate``; a
    model always does), then one target forward verifying K + 1 tokens for a row that proposed
    and one token for a row that did not. ``draft`` None or ``k`` 0: a plain target step."""
    if draft is None or k == 0:
        return target.ms(rows, rows * (1 + propose_rate * k))
    drafting = 1.0 - (1.0 - propose_rate) ** rows  # the chance that some row proposes
    return drafting * k * draft.ms(rows, rows) / draft_speed + target.ms(rows, rows * (1 + propose_rate * k))


@dataclass
class DraftProfile:
    cost: CostModel = field(metadata=doc("one draft forward on the measuring machine"))
    acceptance: dict[str, list[float]] = field(
        metadata=doc("domain -> P(draft position i accepted), unconditional; key `all` for other domains")
    )
    proposes: dict[str, float] = field(
        default_factory=dict,
        metadata=doc(
            "domain -> the fraction of decode steps on which the drafter proposes anything (key `all` for "
            "other domains; 1 where absent). A model-free drafter (vLLM's ngram) that finds no match runs "
            "a plain one-token step; `acceptance` still counts every step"
        ),
    )
    step: CostModel | None = field(default=None, metadata=doc(
        "a whole step of this drafter (its draft forwards and the verify, proposing as often as measured), "
        "measured as one at several batch sizes (bench_vllm_fleet.py profile: 1 row and --batch rows of a "
        "vLLM pool); where present, serve --backend vllm prices the pool's step at its load with it instead "
        "of composing the target's and the draft's costs (the simulator composes them)"))  # fmt: skip
    step_k: int | None = field(default=None, metadata=doc(
        "the K (num_speculative_tokens) `step` was measured at: a pool of another K composes its step"))

    def __post_init__(self) -> None:
        if not self.acceptance:
            raise ValueError("acceptance needs at least one domain (or `all`)")
        for domain, curve in self.acceptance.items():
            if not curve or any(not 0.0 <= p <= 1.0 for p in curve):
                raise ValueError(f"acceptance.{domain}={curve} must be a non-empty list of probabilities in [0, 1]")
        for domain, rate in self.proposes.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"proposes.{domain}={rate} must be in [0, 1]: the fraction of steps with a proposal")
        for domain in {*self.acceptance, *self.proposes}:
            rate = self.propose_rate(domain)
            if any(c > rate + 1e-9 for c in self.curve(domain)):
                raise ValueError(f"acceptance.{domain}={self.curve(domain)} exceeds proposes.{domain}={rate}: "
                                 "a position can only be accepted on a step that proposed it")  # fmt: skip

        if self.step is not None and (self.step_k is None or self.step_k < 1):
            raise ValueError(f"step_k={self.step_k}: a measured step needs the K it was measured at (>= 1)")

    def curve(self, domain: str) -> list[float]:
        return self.acceptance.get(domain) or self.acceptance.get("all") or next(iter(self.acceptance.values()))

    def propose_rate(self, domain: str) -> float:
        return self.proposes.get(domain, self.proposes.get("all", 1.0))


@dataclass
class LengthDist:
    samples: list[int] = field(default_factory=list, metadata=doc("measured lengths, resampled uniformly (wins over mean/cv)"))
    mean: float = field(default=0.0, metadata=doc("mean length when no samples are given"))
    cv: float = field(default=0.0, metadata=doc("coefficient of variation: 0 = always `mean`, > 0 = log-normal"))
    min: int = field(default=1, metadata=doc("lower clip"))
    max: int | None = field(default=None, metadata=doc("upper clip"))

    def __post_init__(self) -> None:
        if not self.samples and self.mean <= 0:
            raise ValueError("a length distribution needs samples or a mean > 0")
        if any(s < 1 for s in self.samples):
            raise ValueError(f"samples={self.samples[:8]}... must all be >= 1")
        if self.cv < 0 or self.min < 1 or (self.max is not None and self.max < self.min):
            raise ValueError(f"cv={self.cv}, min={self.min}, max={self.max}: need cv >= 0 and 1 <= min <= max")

    def expected(self) -> float:
        return statistics.fmean(self.samples) if self.samples else self.mean

    def sampler(self, rng) -> Any:
        """A zero-argument function drawing one length with ``rng`` (a ``random.Random``)."""
        lo, hi = self.min, self.max if self.max is not None else 1 << 30
        if self.samples:
            s = list(self.samples)
            return lambda: min(hi, max(lo, s[int(rng.random() * len(s))]))
        if self.cv == 0:
            n = min(hi, max(lo, round(self.mean)))
            return lambda: n
        sigma = math.sqrt(math.log1p(self.cv**2))
        mu = math.log(self.mean) - sigma**2 / 2
        return lambda: min(hi, max(lo, round(rng.lognormvariate(mu, sigma))))


@dataclass
class DomainProfile:
    weight: float = field(default=1.0, metadata=doc("share of requests (normalised over domains)"))
    prompt_tokens: LengthDist = field(default_factory=lambda: LengthDist(mean=100), metadata=doc("prompt length"))
    output_tokens: LengthDist = field(default_factory=lambda: LengthDist(mean=128), metadata=doc("generated length"))

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"weight={self.weight} must be >= 0")


@dataclass
class Link:
    latency_ms: float = field(default=0.0, metadata=doc("one-way latency"))
    bandwidth_mbps: float = field(default=1000.0, metadata=doc("megabits per second"))
    jitter_ms: float = field(default=0.0, metadata=doc("mean of an exponential extra delay per message"))

    def __post_init__(self) -> None:
        if self.latency_ms < 0 or self.jitter_ms < 0 or self.bandwidth_mbps <= 0:
            raise ValueError(f"latency_ms={self.latency_ms}, jitter_ms={self.jitter_ms} must be >= 0, bandwidth_mbps={self.bandwidth_mbps} > 0")


@dataclass
class Profile:
    target: CostModel = field(metadata=doc("one target forward (prefill, verify or plain step)"))
    drafts: dict[str, DraftProfile] = field(metadata=doc("draft name -> its cost and acceptance"))
    domains: dict[str, DomainProfile] = field(metadata=doc("domain -> traffic share and lengths"))
    network: dict[str, Link] = field(default_factory=dict, metadata=doc("measured links by name"))
    meta: dict[str, Any] = field(default_factory=dict, metadata=doc("provenance"))
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if not self.drafts:
            raise ValueError("drafts: a profile needs at least one draft")
        if not self.domains or sum(d.weight for d in self.domains.values()) <= 0:
            raise ValueError("domains: a profile needs at least one domain with weight > 0")
        if self.version != PROFILE_VERSION:
            raise ValueError(f"version={self.version}: this Choral reads profile version {PROFILE_VERSION}")

    def save(self, path: str | Path) -> Path:
        """YAML, or JSON when the name ends in .json; written atomically."""
        path = Path(path)
        data = to_dict(self)
        text = json.dumps(data, indent=1) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        return path


def load_profile(path: str | Path) -> Profile:
    """Read a YAML or JSON profile; problems raise ``ConfigError`` naming the key and the file."""
    return load_config(Profile, path)


def iid_curve(a: float, k: int) -> list[float]:
    """Per-position acceptance when every position is accepted with probability ``a`` given the
    ones before it were: ``[a, a^2, ..., a^k]``."""
    return [a ** (i + 1) for i in range(k)]


def geometric_rate(tokens_per_call: float, k: float) -> float:
    """The i.i.d. per-position rate ``a`` whose expected tokens per target call with ``k`` drafts,
    ``sum(a^i, i=0..k)``, equals the measured one (bisection; what a bench without per-position
    counts implies)."""
    k = max(1, round(k))
    want = min(max(tokens_per_call, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(k + 1)) < want else (lo, mid)
    return (lo + hi) / 2


def from_bench(bench: str | Path | dict, base: Profile | None = None) -> Profile:
    """A profile from ``spec-bench``'s ``bench.json`` (a path or the loaded report).

    Target: one-token steps, (K+1)-token verifications and prefills of every prompt (all one row,
    so ``per_row_ms`` stays 0: the bench cannot see batching). Draft: its measured step, and its
    prefill as the speculative run's prefill minus the target's. Acceptance per domain: the rows'
    ``per_position_acceptance`` when the bench recorded it, else the i.i.d. rate that reproduces
    the domain's tokens per target call. Lengths: the prompts' and outputs' measured lengths."""
    report = json.loads(Path(bench).read_text()) if not isinstance(bench, dict) else bench
    cfg, rows_by_domain = report.get("config", {}), report.get("rows", {})
    rows = [r for rs in rows_by_domain.values() for r in rs]
    if not rows:
        raise ValueError(f"{bench if not isinstance(bench, dict) else 'bench report'} has no rows: run spec-bench first")
    k = int(cfg.get("k", 4))
    target_pts, draft_pts = [], []
    for r in rows:
        calls = max(1, r.get("target_calls", 1))
        width = 1 + r.get("drafted", k * calls) / calls
        target_pts.append(CostPoint(1, 1, r["target_step_ms"]))
        target_pts.append(CostPoint(1, width, r["verify_ms"]))
        t_prefill = 1e3 * (r["target_s"] - r["target_decode_s"])
        if t_prefill > 0:
            target_pts.append(CostPoint(1, r["prompt_tokens"], t_prefill, "prefill"))
        draft_pts.append(CostPoint(1, 1, r["draft_step_ms"]))
        d_prefill = 1e3 * (r["spec_s"] - r["spec_decode_s"]) - t_prefill
        if d_prefill > 0:
            draft_pts.append(CostPoint(1, r["prompt_tokens"], d_prefill, "prefill"))
    acceptance = {}
    for domain, rs in list(rows_by_domain.items()) + [("all", rows)]:
        acceptance[domain] = _bench_curve(rs, k)
    domains = {
        d: DomainProfile(
            weight=float(len(rs)),
            prompt_tokens=LengthDist(samples=[r["prompt_tokens"] for r in rs]),
            output_tokens=LengthDist(samples=[r["spec_tokens"] for r in rs]),
        )
        for d, rs in rows_by_domain.items()
        if rs
    }
    name = Path(str(cfg.get("draft", "draft"))).name
    meta = {
        "source": "spec-bench", "file": str(bench) if not isinstance(bench, dict) else None,
        "command": cfg.get("command"), "machine": cfg.get("machine"), "target": cfg.get("target"),
        "draft": cfg.get("draft"), "dtype": cfg.get("dtype"), "device": cfg.get("device"), "k": k,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }  # fmt: skip
    return Profile(
        target=CostModel.fit(target_pts),
        drafts={**(base.drafts if base else {}), name: DraftProfile(cost=CostModel.fit(draft_pts), acceptance=acceptance)},
        domains=domains,
        network=dict(base.network) if base else {},
        meta=meta,
    )


def _bench_curve(rows: list[dict], k: int) -> list[float]:
    with_curve = [r for r in rows if r.get("per_position_acceptance")]
    if with_curve:
        return _mean_curves([(r["per_position_acceptance"], r.get("target_calls", 1)) for r in with_curve])
    calls = sum(r.get("target_calls", 0) for r in rows)
    if not calls:
        raise ValueError("bench rows lack target_calls: cannot tell acceptance")
    per_call = sum(r["spec_tokens"] - 1 for r in rows) / calls
    drafted = sum(r.get("drafted", k * r["target_calls"]) for r in rows) / calls
    return iid_curve(geometric_rate(per_call, drafted), k)


def _mean_curves(curves: list[tuple[list[float], float]]) -> list[float]:
    """Weighted mean of per-position curves of different lengths, made non-increasing (a later
    position cannot be accepted more often than an earlier one; small samples can say so)."""
    n = max(len(c) for c, _ in curves)
    out = []
    for i in range(n):
        pts = [(c[i], w) for c, w in curves if i < len(c) and w > 0]
        if not pts:
            break
        out.append(sum(p * w for p, w in pts) / sum(w for _, w in pts))
    for i in range(1, len(out)):
        out[i] = min(out[i], out[i - 1])
    return out


def from_router_data(path: str | Path, base: Profile | None = None) -> Profile:
    """A profile from ``collect-router-data`` JSONL: one row per (prompt, draft) run.

    Fields used when present: ``domain``, ``draft``, ``per_position_acceptance`` (else
    ``acceptance_rate`` with ``k``/``mean_k``, assumed i.i.d.), ``draft_step_ms``,
    ``target_step_ms`` (a verification of ``mean_k``/``k`` + 1 tokens), ``prompt_tokens``,
    ``new_tokens``, ``target_calls`` (weights the acceptance). Rows without a domain count as
    ``all``, without a draft as ``draft``. What the rows lack comes from ``base``; without a base a
    missing target or draft timing is an error naming the field."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {i + 1} is not JSON: {e}") from None
    if not rows:
        raise ValueError(f"{path} has no rows")
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("draft") == "none":
            continue  # the target alone: only its one-token step time is used (below)
        groups.setdefault(str(r.get("draft") or "draft"), []).append(r)
    drafts = dict(base.drafts) if base else {}
    for name, rs in groups.items():
        acc: dict[str, list[float]] = {}
        by_domain: dict[str, list[dict]] = {}
        for r in rs:
            by_domain.setdefault(str(r.get("domain") or "all"), []).append(r)
        for domain, group in list(by_domain.items()) + ([("all", rs)] if "all" not in by_domain else []):
            curves = [(_row_curve(r), float(r.get("target_calls") or r.get("new_tokens") or 1)) for r in group]
            curves = [(c, w) for c, w in curves if c]
            if curves:
                acc[domain] = _mean_curves(curves)
        pts = [CostPoint(1, 1, float(r["draft_step_ms"])) for r in rs if r.get("draft_step_ms")]
        if pts:
            cost = CostModel.fit(pts)
        elif name in drafts:
            cost = drafts[name].cost
        else:
            raise ValueError(f"{path}: rows of draft {name!r} have no draft_step_ms and no base profile supplies it")
        if not acc:
            if name not in drafts:
                raise ValueError(f"{path}: rows of draft {name!r} have neither per_position_acceptance nor acceptance_rate")
            acc = drafts[name].acceptance
        drafts[name] = DraftProfile(cost=cost, acceptance=acc)
    def width(r: dict) -> float:
        # Tokens per row in the row's target step: 1 for the target alone, else K + 1.
        if r.get("draft") == "none":
            return 1.0
        k = r.get("mean_k") if r.get("mean_k") is not None else r.get("k")
        return 1.0 + float(4 if k is None else k)

    tpts = [CostPoint(1, width(r), float(r["target_step_ms"])) for r in rows if r.get("target_step_ms")]
    if tpts:
        target = CostModel.fit(tpts + [p for p in (base.target.points if base else []) if p.kind == "prefill"])
    elif base:
        target = base.target
    else:
        raise ValueError(f"{path}: no row has target_step_ms and no base profile supplies the target's cost")
    domains = _domains_from_requests(rows, "new_tokens") or (dict(base.domains) if base else {})
    if not domains:
        raise ValueError(f"{path}: rows have no prompt_tokens/new_tokens and no base profile supplies lengths")
    meta = {"source": "collect-router-data", "file": str(path), "rows": len(rows), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return Profile(target=target, drafts=drafts, domains=domains, network=dict(base.network) if base else {}, meta=meta)


def _row_curve(r: dict) -> list[float]:
    if r.get("per_position_acceptance"):
        return [float(p) for p in r["per_position_acceptance"]]
    if r.get("acceptance_rate") is not None:
        k = max(1, round(float(r.get("mean_k") or r.get("k") or 4)))
        # acceptance_rate = mean of the k unconditional position rates = (1/k) sum a^(i+1).
        want = 1 + k * float(r["acceptance_rate"])
        return iid_curve(geometric_rate(want, k), k)
    return []


def _domains_from_requests(rows: list[dict], out_key: str) -> dict[str, DomainProfile]:
    by: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("prompt_tokens") and r.get(out_key):
            by.setdefault(str(r.get("domain") or "all"), []).append(r)
    return {
        d: DomainProfile(
            weight=float(len(rs)),
            prompt_tokens=LengthDist(samples=[int(r["prompt_tokens"]) for r in rs]),
            output_tokens=LengthDist(samples=[int(r[out_key]) for r in rs]),
        )
        for d, rs in by.items()
    }


def from_load_test(result: str | Path | dict, base: Profile | None = None, k: int = 4) -> Profile:
    """A profile from the server's load test result (a path or the loaded JSON).

    Fields read (all optional; what is missing comes from ``base``, and a profile without a
    target cost, a draft and lengths is an error naming what to add):

    * ``rows`` (what ``scripts/load_test.py`` writes) or ``requests``: ``[{prompt_id or domain,
      prompt_tokens, completion_tokens or output_tokens, draft, tokens_per_target_call, ok}]`` ->
      lengths, domain mix (the prompt id's prefix up to ``/``), and when ``server`` has no
      acceptance, the i.i.d. curve reproducing the rows' tokens per target call at ``k``.
    * ``server.steps``: ``[{rows, tokens_per_row, ms, kind: step|prefill}]`` target forwards the
      server timed -> the target cost model (this is what sees batching).
    * ``server.draft``: draft name; ``server.draft_steps``: ``[{rows, tokens_per_row, ms}]`` or
      ``server.draft_step_ms`` -> the draft's cost.
    * ``server.per_position_acceptance``: a list, or ``{domain: list}`` -> acceptance.
    * ``network``: ``{name: {latency_ms, bandwidth_mbps}}`` measured between client and server.

    The measured outcome (``throughput_tokens_per_s``, ``ttft_ms``/``itl_ms``/``e2e_ms``
    percentiles) is what ``scripts/experiments/calibrate_simulator.py`` compares the simulator with; it is not
    part of the profile."""
    data = json.loads(Path(result).read_text()) if not isinstance(result, dict) else result
    server = data.get("server") or {}
    requests = []
    for r in data.get("requests") or data.get("rows") or []:
        if r.get("ok", True):
            domain = r.get("domain") or (str(r["prompt_id"]).split("/")[0] if r.get("prompt_id") else "all")
            requests.append(r | {"domain": domain, "output_tokens": r.get("output_tokens") or r.get("completion_tokens")})
    steps = [_point(s) for s in server.get("steps") or []]
    if steps and any(p.kind == "step" for p in steps):
        if base and not any(p.kind == "prefill" for p in steps):
            steps += [p for p in base.target.points if p.kind == "prefill"]
        target = CostModel.fit(steps)
    elif base:
        target = base.target
    else:
        raise ValueError("load test result has no server.steps and no base profile supplies the target's cost")
    drafts = dict(base.drafts) if base else {}
    name = str(server.get("draft") or (next(iter(drafts)) if drafts else "draft"))
    old = drafts.get(name)
    dpts = [_point(s) for s in server.get("draft_steps") or []]
    if not dpts and server.get("draft_step_ms"):
        dpts = [CostPoint(1, 1, float(server["draft_step_ms"]))]
    if old and not any(p.kind == "prefill" for p in dpts):
        dpts += [p for p in old.cost.points if p.kind == "prefill"]
    # Prefill points from the base alone are no measurement of the draft: keep the base's cost.
    cost = CostModel.fit(dpts) if any(p.kind == "step" for p in dpts) else (old.cost if old else None)
    ppa = server.get("per_position_acceptance")
    acc = {"all": [float(p) for p in ppa]} if isinstance(ppa, list) and ppa else (
        {d: [float(p) for p in c] for d, c in ppa.items()} if isinstance(ppa, dict) and ppa else None)  # fmt: skip
    if acc is None and any(r.get("tokens_per_target_call") for r in requests):
        acc = {}
        by: dict[str, list[dict]] = {}
        for r in requests:
            if r.get("tokens_per_target_call"):
                by.setdefault(r["domain"], []).append(r)
        for domain, rs in list(by.items()) + [("all", [r for g in by.values() for r in g])]:
            # Weighted by each request's calls: total tokens after the first over total calls.
            calls = sum((r["output_tokens"] - 1) / r["tokens_per_target_call"] for r in rs)
            if calls > 0:
                acc[domain] = iid_curve(geometric_rate(sum(r["output_tokens"] - 1 for r in rs) / calls, k), k)
    acc = acc or (old.acceptance if old else None)
    if cost is None or acc is None:
        raise ValueError(f"load test result lacks server.draft_step_ms/per_position_acceptance for draft {name!r} and no base profile has it")
    drafts[name] = DraftProfile(cost=cost, acceptance=acc)
    domains = _domains_from_requests(requests, "output_tokens") or (dict(base.domains) if base else {})
    if not domains:
        raise ValueError("load test result has no requests with prompt_tokens/output_tokens and no base profile supplies lengths")
    network = dict(base.network) if base else {}
    for lname, link in (data.get("network") or {}).items():
        network[lname] = Link(**{k: float(v) for k, v in link.items() if k in ("latency_ms", "bandwidth_mbps", "jitter_ms")})
    meta = {"source": "load-test", "file": str(result) if not isinstance(result, dict) else None,
            "config": data.get("config"), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
    return Profile(target=target, drafts=drafts, domains=domains, network=network, meta=meta)


def _point(s: dict) -> CostPoint:
    try:
        return CostPoint(int(s["rows"]), float(s["tokens_per_row"]), float(s["ms"]), s.get("kind", "step"))
    except KeyError as e:
        raise ValueError(f"timed step {s} lacks {e.args[0]!r} (needs rows, tokens_per_row, ms)") from None


def with_target(profile: Profile, **coefficients: float) -> Profile:
    """A copy with some target cost coefficients replaced (what-if studies, tests)."""
    return replace(profile, target=replace(profile.target, **coefficients))


def _lstsq(a: list[list[float]], b: list[float]) -> list[float] | None:
    import numpy as np

    A, B = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if np.linalg.matrix_rank(A) < A.shape[1]:
        return None
    return [float(x) for x in np.linalg.lstsq(A, B, rcond=None)[0]]


__all__ = [
    "ConfigError", "CostModel", "CostPoint", "DomainProfile", "DraftProfile", "LengthDist", "Link", "Profile",
    "from_bench", "from_load_test", "from_router_data", "geometric_rate", "iid_curve", "load_profile",
    "with_target",
]  # fmt: skip
