"""The router's cost model: predicted acceptance -> predicted speedup over the target alone.

    model = router.cost_model
    speed, k = model.speedups(acceptance, occupancy=1, prompt_tokens=lengths)  # [N, D] each
    model.break_even("ngram", k=4)   # the acceptance rate below which drafting loses

Per call (Leviathan et al.): with per-token acceptance a and K drafted tokens a step commits
E = (1 - a^(K+1)) / (1 - a) tokens for K draft forwards and one verification, so relative to the
target alone (one forward per token) the speedup is E / (K c + v), with c = draft step / target
step and v = verification step / target step, both measured by collect-router-data. The router
predicts the measured acceptance *rate* at the collected K_c (accepted / drafted = mean of a^i,
i = 1..K_c, lower than a), so the model first solves for the per-token a behind that rate. The
formulas for E and a are the engine's (``serving.engine.goodput``), shared, not copied.

What the plain formula misses, each priced from what train-router measured (``costs`` per drafter,
``info`` of router.pt):

- **Fill.** ``ngram`` and ``suffix`` propose fewer than K tokens, or none, where they find no
  match, so their acceptance per drafted token says little about what a call commits. A drafter's
  measured fill (``costs[d]["fill"]``, or a line in the prompt's length, ``fill_line``: copying
  drafters fill more slots of a longer prompt) scales the drafted part: a call commits
  1 + fill (E - 1). Such a drafter also widens the verify only on the calls where it proposes.
- **Load** (the goodput view of SmartSpec and TurboSpec). A verify of 8 rows costs more than one
  of 1, so a draft is worth less in a full batch. The verification cost at occupancy b and K is
  v + g(b, K) - g(1, K_c), g(b, K) the cost of a step in which all b rows verify K + 1 tokens
  relative to one in which they verify one: read off a measured step table (``info["step_table"]``,
  T(b, n) for b rows of n tokens; g = T(b, K + 1) / T(b, 1)) where there is one, else from a straight
  line fitted to the collected batch-1 steps (``info["step_model"]``), which underrates batched
  verifies once they stop being bound by reading the weights.
- **The wider verify's scale.** The step table is measured with every slot a real token; where a
  drafter was also collected at a second K (train-router's ``curve_data``), its shift is scaled
  (``costs[d]["verify_shift_scale"]``, ``fit_shift_scale``) so that the mean predicted speedup at
  that K matches the measured one. The rows are collected at batch one, so the scale applies there.
- **A drafter's own work does not share.** The verify width is the batch's, but a draft model's
  forwards run for its own rows while every row of the batch waits. At occupancy b a drafter's cost
  c (and a draft model's own prefill) weighs b T(1, 1) / T(b, 1) times what it weighs alone
  (``draft_share``): the batch gains only if the draft's extra tokens outweigh b rows' worth of the
  time its drafter takes.
- **Prefill.** A measured speedup is a whole request's, both prefills included, so a long prompt
  dilutes every drafter's speedup and a draft model also pays its own prefill. With a prefill model
  (``info["prefill"]``: the target's prefill in target steps p(L) = p0 + p1 L for a prompt of L
  tokens, each drafter's own p_d(L) on top, and the answer's length n) and the prompt's length, a
  request runs p + n steps alone and p + p_d + (n / E) (K c + v) with the drafter, so the speedup
  is E (p + n) / (E (p + p_d) + n (K c + v)); without the length, the per-call ratio.
- **Calibration.** v measured as a verify step alone misses what a call costs beyond it (host work
  between steps, the prefills); ``calibrated_verify_cost`` fits v so that the model reproduces the
  training prompts' measured speedups on average.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serving.engine.engine_settings import HOST_DRAFTERS
from serving.engine.goodput import committed_tokens, expected_tokens, per_token_acceptance, step_ms


def speedup_model(a: torch.Tensor, k: torch.Tensor, draft_cost: float, verify_cost: float,
                  fill: float = 1.0) -> torch.Tensor:  # fmt: skip
    """Predicted speedup over the target alone per call: committed tokens / (K c + v)."""
    return committed_tokens(a, k, fill) / (k * draft_cost + verify_cost)


def rate_of(a: float, k: int) -> float:
    """The acceptance rate (accepted / drafted at K = ``k``) of per-token acceptance ``a``."""
    return sum(a**i for i in range(1, k + 1)) / k if k else 0.0


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
    drafter that copies from the prompt (``ngram``, ``suffix``) fills more of its slots the longer
    the prompt. None when the rows cannot separate the two terms (fewer than two lengths, or
    nothing predicted)."""
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
    model ``prefill``: E (p + n) / (E (p + s p_d) + n cost), a draft's own prefill weighed by its
    ``draft_share`` s of the batch (``CostModel.draft_share``)."""
    n = float(prefill["new_tokens"])
    p = prefill_steps(prefill["target"], prompt_tokens)[:, None, None]  # [N, 1, 1]
    lines = prefill.get("drafts", {})
    p_d = torch.stack([prefill_steps(lines.get(d, (0.0, 0.0)), prompt_tokens) for d in drafts], 1)[:, :, None]  # [N, D, 1]
    e = tokens_per_call
    return e * (p + n) / (e * (p + draft_share * p_d) + n * call_cost)


class CostModel:
    """Each drafter's predicted speedup, from its costs and what router.pt's ``info`` measured.

    drafts: the drafters priced, in the order of the acceptance columns [.., D] every method takes.
    draft_refs: drafter -> reference; the host drafters (``ngram``, ``suffix``) propose only where
        they find a match, so they pay a wider verify only then.
    costs: per drafter, ``draft_cost`` c and ``verify_cost`` v relative to a target step, and where
        measured ``fill``, ``fill_line`` and ``verify_shift_scale`` (the module docstring).
    k_buckets: the K a choice may suggest.
    info: router.pt's ``info``, read when pricing (so a caller may fill it in after construction):
        ``collected_k``, ``step_table``, ``step_model`` and ``prefill``.
    """

    def __init__(self, drafts: list[str], draft_refs: dict[str, str | None], costs: dict[str, dict],
                 k_buckets: Sequence[int], info: dict) -> None:  # fmt: skip
        self.drafts = list(drafts)
        self.copies = torch.tensor([draft_refs[n] in HOST_DRAFTERS for n in self.drafts])  # [D] bool
        # Scalars, and lines ([intercept, slope] such as fill_line) as lists of floats.
        self.costs = {n: {k: [float(x) for x in v] if isinstance(v, (list, tuple)) else float(v) for k, v in costs[n].items()}
                      for n in self.drafts}  # fmt: skip
        self.k_buckets = sorted(int(k) for k in k_buckets)
        self.info = info

    @property
    def collected_k(self) -> int:
        """The K the rows were collected at: the acceptance rates the router predicts are at it."""
        return int(self.info.get("collected_k") or 4)

    # ---- the step's cost -----------------------------------------------------------------------

    def verify_shift(self, ks: torch.Tensor, occupancy: int) -> torch.Tensor:
        """g(b, K) - g(1, K_c) for each K of ``ks`` [Kb] (the module docstring); zeros without a
        step table or model."""
        table = self.info.get("step_table")
        kc = float(self.collected_k)
        if table:
            at_b = step_ms(table, occupancy, ks + 1) / step_ms(table, occupancy, 1.0)
            return at_b - step_ms(table, 1, kc + 1) / step_ms(table, 1, 1.0)
        model = self.info.get("step_model")
        if not model or model.get("per_token_ms", 0.0) <= 0:
            return torch.zeros_like(ks)
        base, t = float(model["base_ms"]), float(model["per_token_ms"])

        def g(b: float, k: torch.Tensor) -> torch.Tensor:
            return (base + b * t + b * k * t) / (base + b * t)

        return g(float(occupancy), ks) - g(1.0, torch.tensor(kc))

    def draft_share(self, occupancy: int) -> float:
        """What a drafter's own work (its K forwards a call, a draft model's prefill) costs at
        occupancy b relative to a batch of one, in the row's steps: b T(1, 1) / T(b, 1). 1 at b = 1."""
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
        widens = torch.where(self.copies[None, :, None], fill, torch.ones_like(fill))  # [N, D, 1]
        return ks * c * self.draft_share(occupancy) + v + widens * scale * self.verify_shift(ks, occupancy)

    # ---- speedups ------------------------------------------------------------------------------

    def speed_table(self, acceptance: torch.Tensor, ks: torch.Tensor, occupancy: int = 1,
                    prompt_tokens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:  # fmt: skip
        """Predicted speedup [N, D, Kb] of each drafter at each K of ``ks`` [Kb] from acceptance
        rates [N, D], for a batch of ``occupancy`` rows; with the prompts' lengths [N] and a prefill
        model (``info["prefill"]``), whole-request speedups, prefills included."""
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

    def speedups(self, acceptance: torch.Tensor, occupancy: int = 1,
                 prompt_tokens: torch.Tensor | Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Best predicted speedup [N, D] of each drafter over ``k_buckets`` and the K [N, D] at it,
        from acceptance rates [N, D] (``speed_table``'s arguments)."""
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

    # ---- rates ---------------------------------------------------------------------------------

    def rate_at(self, rate: float, k: int) -> float:
        """A predicted acceptance rate (at the collected K) as the rate it means at K = ``k``."""
        return rate_of(float(per_token_acceptance(torch.tensor([float(rate)]), self.collected_k)), k)

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
        return rate_of((lo + hi) / 2, k)


def fit_shift_scale(model: CostModel, draft: str, rates: torch.Tensor, speedups: torch.Tensor, k: int,
                    prompt_tokens: torch.Tensor | None = None, limit: float = 4.0) -> float:  # fmt: skip
    """The scale w in [0, ``limit``] of ``draft``'s verify shift at which ``model`` predicts, from
    acceptance rates [P] at the collected K, the mean of the speedups [P] measured at K = ``k``
    (batch one; prompts' lengths [P] where the model prices prefills). The prediction falls as w
    grows; a measurement outside its range gives 0 or ``limit``. ``model``'s costs are left as
    they were."""
    measured = float(speedups.float().mean())
    saved = model.costs[draft].get("verify_shift_scale")

    def predicted(w: float) -> float:
        model.costs[draft]["verify_shift_scale"] = w
        return model.mean_speedup_at(draft, rates, k, prompt_tokens)

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
            model.costs[draft].pop("verify_shift_scale", None)
        else:
            model.costs[draft]["verify_shift_scale"] = saved
    return (lo + hi) / 2
