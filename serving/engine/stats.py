"""Per-request speculative decoding statistics (snake_case names, as ``spec-generate --json`` prints)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestStats:
    new_tokens: int = 0
    target_calls: int = 0  # verification forwards this request took part in (prefill not counted)
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [K_max]: accepted at draft position i
    drafted_at: list[int] = field(default_factory=list)  # [K_max]: drafted at position i
    draft_steps: int = 0  # draft forwards (each step: K, the first one over two tokens)
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    prefill_time_s: float = 0.0
    total_time_s: float = 0.0
    prefill_reused: bool = False  # the target's prefill was a row's kept one (EngineConfig.reuse_prefill), its time charged
    k_used: list[int] = field(default_factory=list)  # K of each step, for adaptive K
    capped_steps: int = 0  # steps whose K the goodput cap lowered (step_k goodput: the batch's load)
    drafter_steps: dict[str, int] = field(default_factory=dict)  # drafter whose proposal a step verified -> steps

    def record_step(self, k: int, n_accepted: int, n_new: int, draft_s: float, target_s: float, drafter: str | None = None) -> None:
        self.target_calls += 1
        if drafter is not None:
            self.drafter_steps[drafter] = self.drafter_steps.get(drafter, 0) + 1
        self.new_tokens += n_new
        self.drafted += k
        self.accepted += n_accepted
        self.draft_steps += k
        if len(self.drafted_at) < k:
            grow = k - len(self.drafted_at)
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(k):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < n_accepted)
        self.draft_time_s += draft_s
        self.target_time_s += target_s
        self.k_used.append(k)

    def to_dict(self) -> dict:
        calls = max(self.target_calls, 1)
        target_step = self.target_time_s / calls
        draft_step = self.draft_time_s / self.draft_steps if self.draft_steps else 0.0
        return {
            "new_tokens": self.new_tokens,
            "target_calls": self.target_calls,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            # Tokens committed per verification (accepted + the correction/bonus token).
            "mean_accepted_length": (self.new_tokens - 1) / calls if self.target_calls else 0.0,
            "per_position_acceptance": [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
            "draft_time_s": self.draft_time_s,
            "target_time_s": self.target_time_s,
            "prefill_time_s": self.prefill_time_s,
            "prefill_reused": self.prefill_reused,
            "total_time_s": self.total_time_s,
            "draft_step_ms": 1e3 * draft_step,
            "target_step_ms": 1e3 * target_step,
            "draft_target_cost_ratio": draft_step / target_step if target_step else 0.0,
            "tokens_per_second": self.new_tokens / self.total_time_s if self.total_time_s else 0.0,
            "mean_k": sum(self.k_used) / len(self.k_used) if self.k_used else 0.0,
            "drafts": sum(1 for k in self.k_used if k),  # steps that verified a proposal (vLLM's num_drafts)
            "capped_steps": self.capped_steps,  # steps whose K the load lowered (step_k goodput)
            # Which drafter's proposal each step verified ("none": nothing drafted), as shares of the steps.
            "drafter_shares": {d: n / calls for d, n in sorted(self.drafter_steps.items())},
        }
