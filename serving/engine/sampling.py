"""One sampling transform for draft and target, and inverse-CDF sampling from given uniforms.

The same ``probs_from_logits`` turns draft logits into q and target logits into p. Greedy rows
(temperature 0) become one-hot distributions at the argmax, so the rejection-sampling rule in
``serving.engine.acceptance`` reduces exactly to "accept iff the draft token is the target's argmax" and
one code path serves greedy and sampled rows in the same batch.

Every parameter is a per-row tensor so a batch mixes requests with different settings without
changing shapes; random numbers come in as uniforms drawn on the host from per-request generators,
which keeps compiled steps free of RNG state and makes seeded output independent of batching.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


VERIFICATIONS = ("exact", "threshold")
INT64_MAX = 2**63 - 1  # top_k and token ids become int64 tensors
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (chat)


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings of one request.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 disables.
    top_p: keep the smallest set of tokens whose probability reaches top_p; 1.0 disables.
    seed: seeds the request's own generator, so a seeded request is reproducible whatever else
        shares its batch.
    verification: "exact" (the default: rejection sampling, the output is the target's) or
        "threshold" (opt-in, lossy: a draft token is also accepted when the target's probability
        of it, at temperature 1 before top-k/top-p, is at least ``verification_threshold``; see
        ``serving.engine.acceptance.threshold_accepts``).

    Logits processors (``serving.engine.processors``), applied to the target's logits at every
    position a step verifies, each position seeing the draft tokens before it, in vLLM's order:
    logit_bias: (token id, bias) pairs added to the logits (OpenAI: bias in [-100, 100]).
    repetition_penalty: vLLM's and transformers': a logit of a token already in the prompt or
        the output is divided by it if positive, multiplied if negative; 1.0 disables.
    frequency_penalty, presence_penalty: OpenAI's, in [-2, 2]: a logit drops by
        frequency * count + presence * (count > 0), count over generated tokens only.
    min_p: after temperature, drop tokens whose probability is below min_p times the top one's
        (transformers' ``MinPLogitsWarper``, vLLM's min_p); 0 disables.
    logprobs: None, or how many most likely alternatives to return with each generated token's
        own log probability (0..20), of the distribution after the processors and before
        temperature (vLLM's processed logprobs).
    grammar: an llguidance grammar the output must follow (``serving.engine.grammar``: JSON mode,
        a JSON schema): tokens it does not allow get no probability at any verified position.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    verification: str = "exact"
    verification_threshold: float = 0.1
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logprobs: int | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 means greedy)")
        if not (isinstance(self.top_k, int) and 0 <= self.top_k <= INT64_MAX):
            raise ValueError(f"top_k={self.top_k!r} must be an integer in [0, 2**63) (0 disables top-k)")
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed={self.seed!r} must be a 64-bit integer, in [-2**63, 2**64)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] (1 disables top-p)")
        if self.verification not in VERIFICATIONS:
            raise ValueError(f"verification={self.verification!r} must be one of {VERIFICATIONS} ('exact' keeps the "
                             "target's output; 'threshold' trades it for speed)")  # fmt: skip
        if not 0.0 < self.verification_threshold <= 1.0:
            raise ValueError(f"verification_threshold={self.verification_threshold!r} must be in (0, 1] (the target "
                             "probability at or above which a draft token is accepted; 0.1 is the usual)")  # fmt: skip
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be in [-2, 2] (0 disables)")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be a finite number > 0 (1 disables)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1] (0 disables)")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs={self.logprobs!r} must be an integer in 0..{MAX_LOGPROBS} (alternatives per token)")
        for pair in self.logit_bias:
            if not (len(pair) == 2 and isinstance(pair[0], int) and pair[0] >= 0 and -100.0 <= pair[1] <= 100.0):
                raise ValueError(f"logit_bias entry {pair!r} must be (token id >= 0, bias in [-100, 100])")

    @property
    def lossy(self) -> bool:
        """Threshold verification: the output may differ from the target's own."""
        return self.verification == "threshold"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def seeded_sampling(self) -> bool:
        """A sampled request with its own seed: its tokens must not depend on the batch, so nothing
        that other rows decide (a shared draft cache, a step's K cap) may change its draws."""
        return self.seed is not None and not self.greedy

    @property
    def filters(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def processors(self) -> tuple[str, ...]:
        """The logits processors this request uses, by their OpenAI / vLLM field names."""
        used = (("logit_bias", bool(self.logit_bias)), ("repetition_penalty", self.repetition_penalty != 1.0),
                ("frequency_penalty", self.frequency_penalty != 0.0), ("presence_penalty", self.presence_penalty != 0.0),
                ("min_p", self.min_p > 0.0), ("grammar", self.grammar is not None))  # fmt: skip
        return tuple(name for name, on in used if on)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings of a batch, on the device. ``filters`` and ``all_greedy`` are
    static flags (host side): greedy batches skip the softmax, unfiltered ones the vocabulary sort,
    exact ones (``lossy`` False, the default) never compute the threshold rule at all."""

    temperature: torch.Tensor  # [B] float, 0 = greedy
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B] float, 1 = off
    filters: bool
    all_greedy: bool
    threshold: torch.Tensor | None = None  # [B] float: threshold rows' verification_threshold, 0 = exact
    lossy: bool = False  # some row asked for threshold verification (None threshold otherwise)
    min_p: torch.Tensor | None = None  # [B] float, 0 = off (None: no row uses it)
    # The target's logits processors for these rows (serving.engine.processors.ProcessorRows; None:
    # no row uses one); applied where the target verifies, never to a draft's q.
    processors: Any = None
    logprobs: int | None = None  # the most alternatives any row asks for (None: no row asks for logprobs)

    @classmethod
    def build(cls, params: list[SamplingParams], device: torch.device | str, processors: Any = None) -> "SamplingTensors":
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            filters=any(p.filters for p in params),
            all_greedy=all(p.greedy for p in params),
            threshold=torch.tensor([p.verification_threshold if p.lossy else 0.0 for p in params],
                                   dtype=torch.float32, device=device) if any(p.lossy for p in params) else None,
            lossy=any(p.lossy for p in params),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            if any(p.min_p > 0 and not p.greedy for p in params) else None,
            processors=processors,
            logprobs=max(asked) if asked else None,
        )  # fmt: skip

    def rows(self, index: torch.Tensor) -> "SamplingTensors":
        """Rows ``index`` ([n] long); the flags stay the batch's (a superset is always safe)."""
        return dataclasses.replace(self, temperature=self.temperature[index], top_k=self.top_k[index], top_p=self.top_p[index],
                                   threshold=None if self.threshold is None else self.threshold[index],
                                   min_p=None if self.min_p is None else self.min_p[index], processors=None)  # fmt: skip


def probs_from_logits(logits: torch.Tensor, s: SamplingTensors) -> torch.Tensor:
    """Apply temperature, then min_p, top-k and top-p (vLLM's sampler's order).

    logits: [B, T, V] (any float dtype). Returns fp32 probabilities [B, T, V]; greedy rows are
    one-hot at the first argmax, matching ``torch.argmax`` and HF greedy ``generate``.
    """
    logits = logits.float()
    B, T, V = logits.shape
    greedy = (s.temperature == 0)[:, None, None]  # [B, 1, 1]
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), V).to(torch.float32)  # [B, T, V]
    if s.all_greedy:
        return one_hot
    temp = torch.where(s.temperature > 0, s.temperature, 1.0)[:, None, None]
    scaled = logits / temp  # [B, T, V]
    if s.min_p is not None:  # tokens below min_p times the top one's probability (transformers' MinPLogitsWarper)
        probs = scaled.softmax(-1)
        floor = s.min_p[:, None, None] * probs.amax(-1, keepdim=True)  # [B, T, 1]
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    if s.filters:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, T, V]
        rank = torch.arange(V, device=logits.device)  # [V]
        k = torch.where(s.top_k > 0, s.top_k, V)[:, None, None]  # [B, 1, 1]
        sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
        sorted_probs = sorted_logits.softmax(-1)
        # A token stays if the mass strictly before it is below top_p: the first token always stays.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop = mass_before >= s.top_p[:, None, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    probs = scaled.softmax(-1)
    return torch.where(greedy, one_hot, probs)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per distribution by inverse CDF: the first index whose cumulative mass
    exceeds u * total. Exact for any u ~ U[0, 1); zero-probability tokens are never drawn.

    probs: [..., V] non-negative (need not sum to 1); u: [...] uniforms. Returns long [...].
    """
    cdf = probs.cumsum(-1)  # [..., V]
    # Keep u * total strictly below total in fp32, else the search runs off the end.
    target = (u.clamp(max=1.0 - 1e-6) * cdf[..., -1]).unsqueeze(-1)  # [..., 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)
