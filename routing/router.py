"""The router: prompt -> which draft (or none) to speculate with, and a suggested K.

    router = Router.load("runs/router/router.pt")
    choice = router.choose("def fibonacci(n):")
    choice.draft                  # a name from router.draft_names; "none" = the target alone
    router.draft_refs[choice.draft], choice.k, choice.predicted_acceptance

A small MLP reads the prompt's features (sentence embedding + cheap statistics, normalised with
the training set's statistics) and predicts each draft's acceptance rate. ``objective:
acceptance`` picks the highest; ``objective: speedup`` turns each prediction into an expected
speedup with the draft's measured costs and picks the best, or "none" when no draft beats 1.0.

Cost model (Leviathan et al.): with per-token acceptance a and K drafted tokens a step commits
E = (1 - a^(K+1)) / (1 - a) tokens for K draft forwards and one verification, so relative to the
target alone (one forward per token) the speedup is E / (K*c + v) with c = draft step / target
step and v = verification step / target step, both measured during collection. The MLP predicts
the measured acceptance *rate* at the collected K_c (accepted / drafted = mean of a^i, i = 1..K_c,
which is lower than a), so ``speedups`` first solves for the per-token a behind that rate.

Drafters that leave slots empty: ``ngram`` and ``suffix`` propose fewer than K tokens (none at
all) where they find no match, so their acceptance per drafted token says little about what a
call commits. Each drafter's measured **fill** (``costs[d]["fill"]``, from the collected rows: the
tokens its calls actually committed beyond the bonus token over what E(a, K) - 1 predicts from its
acceptance rate) scales the drafted part: a call commits 1 + fill * (E - 1). A draft model fills
almost every slot (fill near 1); on the six-family workload (q4 target) ``suffix`` filled about
half (0.54). Without a measured fill (routers trained before it) fill is 1, the plain model. Such a
drafter also widens the verify only on the calls where it proposes, so the extra width of a K
longer than the collected one (the load shift below) is weighed by its fill too: on the int8 target
at batch one, whose verify is nearly flat in width, ``ngram`` at a fixed K = 8 ran at 2.02x the
target alone over the 30 test prompts, against 1.85x at K = 4 (``scripts/report.py
--workload-extra-k 8``, Intel VM, 2026-11-27).

Load (the goodput view of SmartSpec and TurboSpec): a verify of 8 rows costs more than of 1, so a
draft is worth less in a full batch. With a step model (``info["step_model"]``: a target forward
costs ``base_ms + per_token_ms * tokens`` over all rows, fitted by train-router to the collected
steps), the verification cost at occupancy b and K is v + g(b, K) - g(1, K_c), where
g(b, K) = (T(b) + b K t) / T(b) is a step in which all b rows verify K + 1 tokens relative to one
in which they verify one, T(b) = base + b t: the verify step at (b, K) plus the per-call overhead
that the calibrated v holds beyond the verify step it was measured with. ``choose_batch(...,
occupancy=b)`` chooses for the batch the server has when it admits the request; at b = 1 and
K = K_c this is the plain model. That straight line is fitted to batch-1 steps of 1 and K_c + 1
tokens, where the target is bound by reading its weights; a batch of 8 rows verifying 5 tokens each
is bound by arithmetic and costs far more than the line says (q4 target, Intel VM: 333-387 ms
against 165). With a measured step table (``info["step_table"]``, train-router's ``step_profile``: the
target's forward at rows x tokens per row, ``profile_step.py --batch-rows``) the router reads
T(b, n) for b rows of n tokens off that table (linear between its points, the nearest segment's
slope outside them) and g(b, K) = T(b, K + 1) / T(b, 1).

The wider verify of a longer K is priced from a step table measured with full rows, every slot a
real token. Where a drafter was also collected at a second K (train-router's ``curve_data``), its
shift is scaled (``costs[d]["verify_shift_scale"]``, ``fit_shift_scale``) so that the model's mean
speedup at that K over the training prompts equals the measured one; the rows are collected at
batch one, so the scale applies there only. On the six-family workload (int8 target, Intel VM) the
unscaled model predicted ``ngram`` at K = 8 at 1.63x where the 60 training prompts measured 1.84x
(1.68x at K = 4), while the geometric curve over-predicted its draft tokens accepted per call at
K = 8 (1.82 against 1.64 measured): the error was the width's cost. The step table has a 9-token
verify at 1.32 one-token steps; the rows' own verify steps at K = 8 (median 103 ms for ``ngram``)
cost no more than the target's one-token steps in the same run (106 ms)
(``scripts/experiments/second_k_check.py``, tenth session). train-router fitted the scales ``ngram``
0.02 and ``suffix`` 0.05. On the test split
that router ran ``ngram`` and ``suffix`` at K = 8, as their fixed-K runs favoured, but also chose them
over the 0.5B on code, where the training prompts had measured ``suffix`` at K = 8 ahead (1.73x
against 1.61x) and the test prompts did not (1.29x against 1.70x): 2.01x against 2.04x for the
router without the scale (docs/experiments/router-workload.md, tenth session).

A drafter's own work does not share that way. The verify width is the batch's (and step_k goodput
widens it only where the batch gains), but a draft model's forwards run for its own rows while every
row of the batch waits, and in a mixed batch its rows are few. So at occupancy b a drafter's cost c
(and a draft model's own prefill) weighs b T(1, 1) / T(b, 1) times what it weighs alone
(``draft_share``): the aggregate tokens/s of b rows gains from the request's draft only if its extra
tokens outweigh b rows' worth of the time its drafter takes. On the int8 target (Intel VM) the
0.5B's c = 0.27 becomes 1.5 at b = 8 (its step table: b T(1, 1) / T(b, 1) = 5.5), where the router
that sent it 27 of 72 requests reached 0.88x the best fixed policy's aggregate
(``bench_routed_load.py``, eighth session); ``ngram``'s c = 0.003 stays negligible.

Prefill: a measured speedup is a whole request's, both prefills included, so a long prompt dilutes
every drafter's speedup and a draft model also pays its own prefill (on the six-family workload the
0.5B's residual, measured minus predicted, fell with the prompt's length: correlation -0.73 on the
int8 target, ``scripts/experiments/router_residuals.py``). With a prefill model (``info["prefill"]``,
fitted by train-router to the collected rows: the target's prefill in target steps, p(L) =
p0 + p1 L for a prompt of L tokens, each drafter's own on top, p_d(L), and the answer's length n) and
the prompt's length, a request of n tokens runs p + n steps alone and p + p_d + (n / E) (K c + v)
with the drafter, so the speedup is E (p + n) / (E (p + p_d) + n (K c + v)); without the prompt's
length (or a model), the per-call ratio above.

``Router.create`` builds an untrained but valid router (random MLP, identity normalisation) from
draft references alone, for tests and for wiring a server up before any data is collected.
"""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from routing.features import BUNDLED_EMBEDDER, Featurizer
from serving.engine.engine_settings import HOST_DRAFTERS
from serving.engine.goodput import committed_tokens, expected_tokens, per_token_acceptance, step_ms  # noqa: F401 (re-exported)
from serving.files import atomic_path

FORMAT = "choral-router"
FORMAT_VERSION = 1
# router.pt is this header line, then torch.save's bytes; the header's sha256 covers every byte
# after it, so a flipped byte anywhere is caught (torch.load checks no zip CRC and ignores some bytes).
MAGIC = b"CHORAL-ROUTER sha256="
NONE = "none"
OBJECTIVES = ("acceptance", "speedup")
DEFAULT_K_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8)
# An untrained router's guess at draft cost: a draft ~10x smaller than its target.
DEFAULT_COST = {"draft_cost": 0.1, "verify_cost": 1.0}
_KEYS = (
    "format", "format_version", "draft_names", "draft_refs", "target_ref", "objective", "embedder",
    "cheap_features", "feature_dim", "mean", "std", "mlp", "state_dict", "costs", "k_buckets", "info",
)  # fmt: skip


class RouterError(ValueError):
    """A router file that cannot be used: missing, truncated, another format, or inconsistent."""


@dataclass
class Choice:
    draft: str  # a name from Router.draft_names; "none" = the target alone
    predicted_acceptance: dict[str, float]  # per draft name; "none" -> 0.0
    predicted_speedup: dict[str, float]  # per draft name (at its best K), "none" -> 1.0
    k: int  # suggested K for the chosen draft; 0 for "none"
    occupancy: int = 1  # the batch occupancy the choice was made for
    break_even: float = 0.0  # the chosen draft's acceptance rate at K below which it loses to "none"
    expected_rate: float = 0.0  # the chosen draft's predicted acceptance rate at K (accepted / drafted)

    def fallback_floor(self, ratio: float) -> float:
        """The acceptance below which the request should leave its drafter mid-request (once its
        acceptance so far shows it there: ``serving.engine.core.Fallback``): the lower of the
        break-even rate and ``ratio`` of the prediction (so a drafter predicted near break-even is
        not dropped on the first unlucky tokens). 0 for "none"."""
        if self.draft == NONE:
            return 0.0
        return min(self.break_even, ratio * self.expected_rate)


class RouterMLP(nn.Module):
    """features [N, F] -> acceptance logits [N, D], one per draft (sigmoid gives the rate)."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int = 128, layers: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        width = in_dim
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        blocks.append(nn.Linear(width, out_dim))
        self.net = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def speedup_model(a: torch.Tensor, k: torch.Tensor, draft_cost: float, verify_cost: float,
                  fill: float = 1.0) -> torch.Tensor:  # fmt: skip
    """Predicted speedup over the target alone (see the module docstring)."""
    return committed_tokens(a, k, fill) / (k * draft_cost + verify_cost)


def fit_shift_scale(router: "Router", draft: str, rates: torch.Tensor, speedups: torch.Tensor, k: int,
                    prompt_tokens: torch.Tensor | None = None, limit: float = 4.0) -> float:  # fmt: skip
    """The scale w in [0, ``limit``] of ``draft``'s verify shift at which ``router`` predicts, from
    acceptance rates [P] at the collected K, the mean of the speedups [P] measured at K = ``k``
    (batch one; prompts' lengths [P] where the router prices prefills). The prediction falls as w
    grows; a measurement outside its range gives 0 or ``limit``."""
    measured = float(speedups.float().mean())
    saved = router.costs[draft].get("verify_shift_scale")

    def predicted(w: float) -> float:
        router.costs[draft]["verify_shift_scale"] = w
        return router.mean_speedup_at(draft, rates, k, prompt_tokens)

    lo, hi = 0.0, limit
    try:
        if predicted(lo) <= measured:
            return lo
        if predicted(hi) >= measured:
            return hi
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if predicted(mid) > measured else (lo, mid)
    finally:
        if saved is None:
            router.costs[draft].pop("verify_shift_scale", None)
        else:
            router.costs[draft]["verify_shift_scale"] = saved
    return (lo + hi) / 2


def measured_fill(rates: list[float], accepted_per_call: list[float], k: int) -> float:
    """A drafter's fill from its collected rows: the tokens accepted per call, summed over rows,
    over what the geometric model predicts from each row's acceptance rate at the collected
    ``k`` (E(a, k) - 1). 1.0 when the rows predict nothing to compare with."""
    if not rates or k < 1:
        return 1.0
    a = per_token_acceptance(torch.tensor(rates, dtype=torch.float64), k)  # [N]
    predicted = float((expected_tokens(a, torch.tensor(float(k), dtype=torch.float64)) - 1).sum())
    return sum(accepted_per_call) / predicted if predicted > 1e-9 else 1.0


def measured_fill_line(rates: list[float], accepted_per_call: list[float], lengths: list[float], k: int) -> list[float] | None:
    """A drafter's fill as a line in the prompt's length, [intercept, slope per prompt token]: the
    least-squares fit of each row's tokens accepted per call to (f0 + f1 L) (E(a, k) - 1). A
    drafter that copies from the prompt (``ngram``, ``suffix``) fills more of its slots the longer the
    prompt (on the six-family workload, int8 target: ``ngram`` 0.38-0.55 on the short chat, code and
    math prompts, 0.80-0.90 on the long edit, extract and quoted ones). None when the rows cannot
    separate the two terms (fewer than two lengths, or nothing predicted)."""
    if len(rates) < 2 or len(set(lengths)) < 2 or k < 1:
        return None
    a = per_token_acceptance(torch.tensor(rates, dtype=torch.float64), k)  # [N]
    e = expected_tokens(a, torch.tensor(float(k), dtype=torch.float64)) - 1  # [N]
    x = torch.stack([e, e * torch.tensor(lengths, dtype=torch.float64)], 1)  # [N, 2]
    y = torch.tensor(accepted_per_call, dtype=torch.float64)  # [N]
    gram = x.T @ x  # [2, 2]
    if float(torch.linalg.det(gram)) <= 1e-12 * float(gram.diagonal().prod()):  # the two terms are collinear
        return None
    f0, f1 = torch.linalg.solve(gram, x.T @ y).tolist()
    return [f0, f1]


def fill_of(cost: dict, prompt_tokens: torch.Tensor | None) -> torch.Tensor | float:
    """A drafter's fill: from its line in the prompt's length where it has one and the lengths
    [N] are known (clamped to [0.05, 1]: a fill outside it is an extrapolation), else its one
    measured fill (1.0 without)."""
    line = cost.get("fill_line")
    if line is not None and prompt_tokens is not None:
        return (float(line[0]) + float(line[1]) * prompt_tokens.float()).clamp(0.05, 1.0)
    return float(cost.get("fill", 1.0))


def calibrated_verify_cost(rate: torch.Tensor, speedup: torch.Tensor, k: int, draft_cost: float,
                           fill: float | torch.Tensor = 1.0, prompt_tokens: torch.Tensor | None = None,
                           prefill: dict | None = None, draft: str | None = None) -> float:  # fmt: skip
    """The per-call cost v (relative to a target step) that makes the cost model reproduce measured
    speedups on average: mean of E(a_i) / s_i - k c over prompts i, from acceptance rates [N] and
    measured speedups [N] collected at K = k. A measured speedup also pays for what a verify step
    does not show (both prefills, host work between steps), so this v is usually larger than the
    verify step alone; without it the model promises speedups the measurements never reach and
    never prefers the target alone. NaN when no prompt has a usable measurement or the fit is not
    positive: callers keep the bare verify cost then. With the prompts' lengths [N] and a prefill
    model (``draft``: whose own prefill it pays), the prefills are priced as the speedup model
    prices them and v is the per-call cost that remains: solved per prompt from
    s = E (p + n) / (E (p + p_d) + n (k c + v))."""
    a = per_token_acceptance(rate.float(), k)  # [N]
    ok = (speedup > 0) & torch.isfinite(speedup) & torch.isfinite(rate)
    if not ok.any():
        return float("nan")
    if isinstance(fill, torch.Tensor):
        fill = fill[ok]  # [N] per prompt (a fill line)
    e = committed_tokens(a[ok], torch.tensor(float(k)), fill)  # [N]
    if prefill and prompt_tokens is not None:
        n = float(prefill["new_tokens"])
        lengths = prompt_tokens.float()[ok]
        p = prefill_steps(prefill["target"], lengths)  # [N]
        p_d = prefill_steps(prefill.get("drafts", {}).get(draft, (0.0, 0.0)), lengths)  # [N]
        per_prompt = (e * (p + n) / speedup[ok].float() - e * (p + p_d)) / n - k * draft_cost  # [N]
    else:
        per_prompt = e / speedup[ok].float() - k * draft_cost  # [N]
    v = float(per_prompt.mean())
    return v if v > 0 else float("nan")


def prefill_steps(line: Sequence[float], tokens: torch.Tensor) -> torch.Tensor:
    """A prefill's cost in target steps from a fitted line [intercept, slope per prompt token],
    never below 0."""
    return (float(line[0]) + float(line[1]) * tokens.float()).clamp(min=0.0)


def with_prefill(tokens_per_call: torch.Tensor, call_cost: torch.Tensor, prompt_tokens: torch.Tensor,
                 prefill: dict, drafts: list[str], draft_share: float = 1.0) -> torch.Tensor:  # fmt: skip
    """Whole-request speedups [N, D, Kb] from committed tokens per call and the per-call cost [.., D, Kb]
    (both relative to a target step), for prompts of ``prompt_tokens`` [N] tokens and the prefill
    model ``prefill`` (the module docstring): E (p + n) / (E (p + s p_d) + n cost), a draft's own
    prefill weighed by its ``draft_share`` s of the batch (``Router.draft_share``)."""
    n = float(prefill["new_tokens"])
    p = prefill_steps(prefill["target"], prompt_tokens)[:, None, None]  # [N, 1, 1]
    lines = prefill.get("drafts", {})
    p_d = torch.stack([prefill_steps(lines.get(d, (0.0, 0.0)), prompt_tokens) for d in drafts], 1)[:, :, None]  # [N, D, 1]
    e = tokens_per_call
    return e * (p + n) / (e * (p + draft_share * p_d) + n * call_cost)


class Router:
    def __init__(
        self,
        *,
        draft_names: list[str],
        draft_refs: dict[str, str | None],
        target_ref: str,
        objective: str,
        embedder: str,
        cheap_features: bool,
        mean: torch.Tensor,
        std: torch.Tensor,
        mlp_config: dict,
        state_dict: dict | None,
        costs: dict[str, dict[str, float]],
        k_buckets: list[int],
        info: dict | None = None,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        """Prefer ``Router.load`` or ``Router.create``; train-router builds one from its results.
        draft_names: all choices, "none" included when it was collected (always under
        ``objective="speedup"``, which can fall back to it). costs: per real draft,
        {"draft_cost": c, "verify_cost": v} relative to a target step."""
        if objective not in OBJECTIVES:
            raise RouterError(f"objective={objective!r} must be one of {', '.join(OBJECTIVES)}")
        self.draft_names = list(draft_names)
        self.drafts = [n for n in self.draft_names if n != NONE]  # the MLP's outputs, in order
        if not self.drafts:
            raise RouterError(f"a router needs at least one draft besides {NONE!r}, got {self.draft_names}")
        if len(set(self.draft_names)) != len(self.draft_names):
            raise RouterError(f"draft names repeat: {self.draft_names}")
        if objective == "speedup" and NONE not in self.draft_names:
            self.draft_names.append(NONE)
        self.draft_refs = {n: (None if n == NONE else draft_refs.get(n)) for n in self.draft_names}
        missing = [n for n in self.drafts if not self.draft_refs[n]]
        if missing:
            raise RouterError(f"drafts {missing} have no model reference in draft_refs")
        missing = [n for n in self.drafts if n not in costs]
        if missing:
            raise RouterError(f"drafts {missing} have no measured costs")
        self.target_ref = target_ref
        self.objective = objective
        self.embedder = embedder
        self.cheap_features = cheap_features
        # Scalars, and lines ([intercept, slope] such as fill_line) as lists of floats.
        self.costs = {n: {k: [float(x) for x in v] if isinstance(v, (list, tuple)) else float(v) for k, v in costs[n].items()}
                      for n in self.drafts}  # fmt: skip
        self.k_buckets = sorted(int(k) for k in k_buckets)
        if not self.k_buckets or self.k_buckets[0] < 1:
            raise RouterError(f"k_buckets={k_buckets} must be non-empty positive integers")
        self.info = dict(info or {})
        self.device = torch.device(device)
        self.featurizer = Featurizer(embedder, cheap=cheap_features, device=str(self.device))
        self.mean, self.std = mean.float().to(self.device), std.float().to(self.device)
        if self.mean.shape != (self.featurizer.dim,) or self.std.shape != (self.featurizer.dim,):
            raise RouterError(
                f"normalisation statistics have shape {tuple(self.mean.shape)}/{tuple(self.std.shape)} but "
                f"embedder {embedder!r} with cheap_features={cheap_features} gives {self.featurizer.dim} "
                "features: the file was made with another embedder"
            )
        if not bool((self.std > 0).all()) or not bool(torch.isfinite(self.mean).all()):
            raise RouterError("normalisation statistics must be finite with std > 0")
        self.mlp_config = dict(mlp_config)
        with torch.random.fork_rng(devices=[]):  # seeds the MLP's init without touching the caller's RNG
            torch.manual_seed(seed)
            self.mlp = RouterMLP(self.featurizer.dim, len(self.drafts), **self.mlp_config)
        if state_dict is not None:
            try:
                self.mlp.load_state_dict(state_dict)
            except RuntimeError as e:
                raise RouterError(f"MLP weights do not match its settings {self.mlp_config}: {e}") from None
        self.mlp.to(self.device).eval()

    # ---- building, saving, loading -------------------------------------------------------------

    @classmethod
    def create(
        cls,
        draft_refs: dict[str, str | None],
        target_ref: str,
        embedder: str = BUNDLED_EMBEDDER,
        objective: str = "acceptance",
        seed: int = 0,
        *,
        cheap_features: bool = True,
        hidden: int = 128,
        layers: int = 2,
        costs: dict[str, dict[str, float]] | None = None,
        k_buckets: tuple[int, ...] = DEFAULT_K_BUCKETS,
        device: str = "cpu",
    ) -> "Router":
        """An untrained but valid router: random MLP (seeded), identity normalisation, default
        costs unless given. ``draft_refs``: name -> model reference; a ``"none": None`` entry
        makes the target alone a choice. Its choices are arbitrary until trained; use it to
        build router.pt files for tests or to wire a server before collecting data."""
        names = list(draft_refs)
        costs = costs or {n: dict(DEFAULT_COST) for n in names if n != NONE}
        featurizer = Featurizer(embedder, cheap=cheap_features, device=device)
        return cls(
            draft_names=names,
            draft_refs=draft_refs,
            target_ref=target_ref,
            objective=objective,
            embedder=embedder,
            cheap_features=cheap_features,
            mean=torch.zeros(featurizer.dim),
            std=torch.ones(featurizer.dim),
            mlp_config={"hidden": hidden, "layers": layers, "dropout": 0.0},
            state_dict=None,
            costs=costs,
            k_buckets=list(k_buckets),
            info={"trained": False},
            device=device,
            seed=seed,
        )

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "draft_names": list(self.draft_names),
            "draft_refs": dict(self.draft_refs),
            "target_ref": self.target_ref,
            "objective": self.objective,
            "embedder": self.embedder,
            "cheap_features": self.cheap_features,
            "feature_dim": self.featurizer.dim,
            "mean": self.mean.cpu(),
            "std": self.std.cpu(),
            "mlp": dict(self.mlp_config),
            "state_dict": {k: v.detach().cpu() for k, v in self.mlp.state_dict().items()},
            "costs": self.costs,
            "k_buckets": list(self.k_buckets),
            "info": self.info,
        }

    def save(self, path: str | Path) -> None:
        """Write router.pt atomically (a temporary file renamed over ``path``)."""
        buffer = io.BytesIO()
        torch.save(self.to_dict(), buffer)
        payload = buffer.getvalue()
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            f.write(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n")
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu") -> "Router":
        """Load and validate router.pt (format, version, keys, shapes) and load its embedder, so
        the first ``choose`` is as fast as the rest."""
        path = Path(path)
        data = read_router_file(path)
        try:
            router = cls(
                draft_names=data["draft_names"],
                draft_refs=data["draft_refs"],
                target_ref=data["target_ref"],
                objective=data["objective"],
                embedder=data["embedder"],
                cheap_features=bool(data["cheap_features"]),
                mean=data["mean"],
                std=data["std"],
                mlp_config=data["mlp"],
                state_dict=data["state_dict"],
                costs=data["costs"],
                k_buckets=data["k_buckets"],
                info=data["info"],
                device=device,
            )
        except RouterError as e:
            raise RouterError(f"{path}: {e}") from None
        if router.featurizer.dim != data["feature_dim"]:
            raise RouterError(
                f"{path}: saved for {data['feature_dim']} features but embedder {data['embedder']!r} gives "
                f"{router.featurizer.dim}"
            )
        return router

    # ---- choosing ------------------------------------------------------------------------------

    @torch.inference_mode()
    def predict_acceptance(self, prompts: list[str]) -> torch.Tensor:
        """Predicted acceptance rate [N, D] of each real draft (``self.drafts`` order)."""
        return self.predict_from_features(self.featurizer(prompts))

    @torch.inference_mode()
    def predict_from_features(self, x: torch.Tensor) -> torch.Tensor:
        """Raw (unnormalised) features [N, F] -> predicted acceptance [N, D]."""
        x = (x.to(self.device) - self.mean) / self.std
        return torch.sigmoid(self.mlp(x)).float().cpu()  # [N, D]

    def verify_shift(self, ks: torch.Tensor, occupancy: int) -> torch.Tensor:
        """g(b, K) - g(1, K_c) for each K of ``ks`` (the module docstring); zeros without a step model."""
        table = self.info.get("step_table")
        if table:
            kc = float(self.info.get("collected_k") or 4)
            at_b = step_ms(table, occupancy, ks + 1) / step_ms(table, occupancy, 1.0)
            return at_b - step_ms(table, 1, kc + 1) / step_ms(table, 1, 1.0)
        model = self.info.get("step_model")
        if not model or model.get("per_token_ms", 0.0) <= 0:
            return torch.zeros_like(ks)
        base, t = float(model["base_ms"]), float(model["per_token_ms"])
        kc = float(self.info.get("collected_k") or 4)

        def g(b: float, k: torch.Tensor) -> torch.Tensor:
            return (base + b * t + b * k * t) / (base + b * t)

        return g(float(occupancy), ks) - g(1.0, torch.tensor(kc))

    def _copies(self) -> torch.Tensor:
        """[D] bool: which drafters propose only where they find a match (``ngram``, ``suffix``)."""
        return torch.tensor([self.draft_refs[n] in HOST_DRAFTERS for n in self.drafts])

    def draft_share(self, occupancy: int) -> float:
        """What a drafter's own work (its K forwards a call, a draft model's prefill) costs at
        occupancy b relative to a batch of one, in the row's steps: b T(1, 1) / T(b, 1) (the module
        docstring). 1 at b = 1."""
        if occupancy <= 1:
            return 1.0
        table, model = self.info.get("step_table"), self.info.get("step_model")
        if table:
            grows = float(step_ms(table, occupancy, 1.0) / step_ms(table, 1, 1.0))
        elif model and model.get("per_token_ms", 0.0) > 0:
            base, t = float(model["base_ms"]), float(model["per_token_ms"])
            grows = (base + occupancy * t) / (base + t)
        else:
            grows = 1.0  # nothing says how the target's step grows with the batch
        return occupancy / grows

    def call_cost(self, ks: torch.Tensor, occupancy: int, fill: torch.Tensor) -> torch.Tensor:
        """Each drafter's cost of a call [N, D, Kb] in target steps at each K of ``ks`` [Kb], for a
        batch of ``occupancy`` rows, from the fills [N, D, 1]: K c weighed by its share of the batch,
        v, and the verify shift, which a drafter that proposes only where it finds a match pays only
        then (its fill)."""
        c = torch.tensor([self.costs[n]["draft_cost"] for n in self.drafts])[:, None]  # [D, 1]
        v = torch.tensor([self.costs[n]["verify_cost"] for n in self.drafts])[:, None]  # [D, 1]
        # the shift's scale was fitted to rows collected at batch one; a fuller batch's verify is the step table's
        scale = torch.tensor([float(self.costs[n].get("verify_shift_scale", 1.0)) if occupancy == 1 else 1.0
                              for n in self.drafts])[:, None]  # [D, 1]  # fmt: skip
        widens = torch.where(self._copies()[None, :, None], fill, torch.ones_like(fill))  # [N, D, 1]
        return ks * c * self.draft_share(occupancy) + v + widens * scale * self.verify_shift(ks, occupancy)

    def speedups(self, acceptance: torch.Tensor, occupancy: int = 1,
                 prompt_tokens: torch.Tensor | Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Best predicted speedup [N, D] of each draft over ``k_buckets`` and the K [N, D] at it,
        from acceptance rates [N, D], for a batch of ``occupancy`` rows; with the prompts' lengths
        [N] and a prefill model (``info["prefill"]``), whole-request speedups, prefills included."""
        ks = torch.tensor(self.k_buckets, dtype=torch.float32)  # [Kb]
        s = self.speed_table(acceptance, ks, occupancy, prompt_tokens)  # [N, D, Kb]
        best, idx = s.max(dim=2)  # [N, D]
        return best, ks[idx].long()

    def mean_speedup_at(self, draft: str, rates: torch.Tensor, k: int, prompt_tokens: torch.Tensor | None = None) -> float:
        """``draft``'s predicted speedup at K = ``k`` (batch one), averaged over prompts of
        acceptance rates [P] and lengths [P]."""
        acceptance = torch.zeros(len(rates), len(self.drafts))  # [P, D]: only the draft's column is read
        j = self.drafts.index(draft)
        acceptance[:, j] = rates.float()
        return float(self.speed_table(acceptance, torch.tensor([float(k)]), 1, prompt_tokens)[:, j, 0].mean())

    def speed_table(self, acceptance: torch.Tensor, ks: torch.Tensor, occupancy: int = 1,
                    prompt_tokens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:  # fmt: skip
        """Predicted speedup [N, D, Kb] of each draft at each K of ``ks`` [Kb] (``speedups`` takes
        the best over the router's K buckets)."""
        ks = torch.as_tensor(ks, dtype=torch.float32)
        lengths = None if prompt_tokens is None else torch.as_tensor(prompt_tokens, dtype=torch.float32).reshape(-1)  # [N]
        if lengths is not None and lengths.shape[0] != acceptance.shape[0]:
            raise ValueError(f"{lengths.shape[0]} prompt lengths for {acceptance.shape[0]} prompts: pass one length per prompt")
        n_rows = acceptance.shape[0]
        fill = torch.stack([torch.as_tensor(fill_of(self.costs[n], lengths), dtype=torch.float32).expand(n_rows)
                            for n in self.drafts], 1)[:, :, None]  # [N, D, 1]  # fmt: skip
        a = per_token_acceptance(acceptance.float(), self.collected_k)  # [N, D]
        tokens = committed_tokens(a[:, :, None], ks, fill)  # [N, D, Kb]
        cost = self.call_cost(ks, occupancy, fill)  # [N, D, Kb]
        prefill = self.info.get("prefill")
        if prefill and lengths is not None:
            return with_prefill(tokens, cost, lengths, prefill, self.drafts, self.draft_share(occupancy))  # [N, D, Kb]
        return tokens / cost  # [N, D, Kb]

    @property
    def collected_k(self) -> int:
        return int(self.info.get("collected_k") or 4)

    def rate_at(self, rate: float, k: int) -> float:
        """A predicted acceptance rate (at the collected K) as the rate it means at K = ``k``."""
        a = float(per_token_acceptance(torch.tensor([float(rate)]), self.collected_k))
        return sum(a**i for i in range(1, k + 1)) / k if k else 0.0

    def break_even(self, draft: str, k: int, occupancy: int = 1) -> float:
        """The acceptance rate (accepted / drafted at K = ``k``) at which ``draft`` is predicted
        to be exactly as fast as the target alone: below it, drafting loses."""
        kt = torch.tensor([float(k)])
        fills = torch.tensor([float(fill_of(self.costs[n], None)) for n in self.drafts])[None, :, None]  # [1, D, 1]
        j = self.drafts.index(draft)
        fill = float(fills[0, j, 0])
        cost = float(self.call_cost(kt, occupancy, fills)[0, j, 0])
        lo, hi = 0.0, 1.0  # per-token acceptance a; E(a, K) grows with a
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if float(committed_tokens(torch.tensor(mid), kt, fill)) < cost else (lo, mid)
        a = (lo + hi) / 2
        return sum(a**i for i in range(1, k + 1)) / k

    def decide(self, acceptance: torch.Tensor, occupancy: int = 1,
               prompt_tokens: torch.Tensor | Sequence[int] | None = None) -> list[Choice]:  # fmt: skip
        """The choices the objective makes from acceptance rates [N, D] (predicted by the MLP,
        or by anything else: train-router scores its baselines with the same rule), for a batch
        of ``occupancy`` rows; ``prompt_tokens`` [N], the prompts' lengths, price their prefills
        where the router has a prefill model."""
        speed, best_k = self.speedups(acceptance, occupancy, prompt_tokens)  # [N, D]
        choices = []
        for i in range(acceptance.shape[0]):
            pa = {n: float(acceptance[i, j]) for j, n in enumerate(self.drafts)}
            ps = {n: float(speed[i, j]) for j, n in enumerate(self.drafts)}
            if NONE in self.draft_names:
                pa[NONE], ps[NONE] = 0.0, 1.0
            if self.objective == "acceptance":
                j = int(acceptance[i].argmax())
                draft, k = self.drafts[j], int(best_k[i, j])
            else:  # the target alone unless some draft is predicted to beat it
                j = int(speed[i].argmax())
                draft, k = (self.drafts[j], int(best_k[i, j])) if float(speed[i, j]) > 1.0 else (NONE, 0)
            even = self.break_even(draft, k, occupancy) if draft != NONE else 0.0
            rate = self.rate_at(pa[draft], k) if draft != NONE else 0.0
            choices.append(Choice(draft, pa, ps, k, occupancy, even, rate))
        return choices

    def choose(self, prompt: str, occupancy: int = 1, prompt_tokens: int | None = None) -> Choice:
        return self.choose_batch([prompt], occupancy, None if prompt_tokens is None else [prompt_tokens])[0]

    def choose_batch(self, prompts: list[str], occupancy: int = 1, prompt_tokens: Sequence[int] | None = None) -> list[Choice]:
        """Choices for prompts that join a batch of ``occupancy`` rows (themselves included);
        ``prompt_tokens``: their lengths in the target's tokens (to price the prefills)."""
        if isinstance(prompts, str):
            raise TypeError("choose_batch takes a list of prompts; use choose() for one")
        if occupancy < 1:
            raise ValueError(f"occupancy={occupancy} must be >= 1 (the batch the request joins, itself included)")
        if prompt_tokens is not None and len(prompt_tokens) != len(prompts):
            raise ValueError(f"{len(prompt_tokens)} prompt lengths for {len(prompts)} prompts: pass one length per prompt")
        return self.decide(self.predict_acceptance(list(prompts)), occupancy, prompt_tokens)


def read_router_file(path: str | Path) -> dict:
    """router.pt's checked contents (``Router.to_dict``'s dict), without loading its embedder: the
    one reading path of every role (``serve --role target`` needs only ``target_ref``). Refuses,
    naming the file, one that is missing, empty, truncated, altered anywhere (the header's sha256),
    of another format or version, or without every key."""
    path = Path(path)
    if not path.is_file():
        raise RouterError(f"router file {path} does not exist; build one with `train-router --config ...`")
    raw = path.read_bytes()
    retrain = "re-run train-router (or copy the file again) to write it whole"
    if raw.startswith(MAGIC):
        header, _, payload = raw.partition(b"\n")
        if hashlib.sha256(payload).hexdigest().encode() != header[len(MAGIC) :]:
            raise RouterError(f"{path} fails its sha256 check: the file was altered or cut short; {retrain}")
    elif raw.startswith(b"PK\x03\x04"):  # written before the header existed: the zip's own CRCs only
        payload = raw
        try:
            bad = zipfile.ZipFile(io.BytesIO(raw)).testzip()
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise RouterError(f"{path} is not a readable router file (truncated or corrupt?): {e}; {retrain}") from None
        if bad is not None:
            raise RouterError(f"{path} fails the CRC check of its member {bad!r}: the file is corrupt; {retrain}")
    else:
        what = "empty" if not raw else "not a Choral router file (no router header)"
        raise RouterError(f"{path} is {what}; pass the router.pt that train-router wrote")
    try:
        data = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:
        raise RouterError(f"{path} is not a readable router file (truncated or corrupt?): {type(e).__name__}: {e}; {retrain}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RouterError(f"{path} is not a Choral router file (no format={FORMAT!r} marker)")
    if data.get("format_version") != FORMAT_VERSION:
        raise RouterError(
            f"{path} has router format version {data.get('format_version')!r}; this Choral reads version "
            f"{FORMAT_VERSION}: retrain it with this version's train-router"
        )
    missing = [k for k in _KEYS if k not in data]
    if missing:
        raise RouterError(f"{path} lacks the keys {missing}: the file is incomplete, retrain it")
    return data
