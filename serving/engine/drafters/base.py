"""The drafter interface: what proposes a request's next tokens before the target checks them.

A drafter proposes up to K tokens for a row, with the distributions q they were drawn from. Two
kinds exist, and one engine runs any mix of them in one batch:

* A **model** drafter (``serving.engine.drafters.model``) is a causal LM on the target's tokenizer. It runs
  on the device over the whole static batch, as the first half of the speculative step, and gives
  q from its logits under the request's sampling settings.
* A **host** drafter (this module's ``HostDrafter``: ``ngram``, ``suffix``, ``prediction``) reads the
  request's tokens on the host and proposes tokens without a model. Its proposal is a point mass,
  q = one-hot at each token, so the acceptance rule (``serving.engine.acceptance``) accepts token x with
  probability min(1, p(x)) and on rejection draws from norm(max(0, p - q)): the target's own
  distribution with x taken out. The output follows p exactly, sampled or greedy, whatever the
  drafter proposes; a proposal only changes how many tokens a target call yields.

``none`` (the target alone) is the absence of a drafter: its rows verify one token per step.

A host drafter is called on the engine's thread only, once per row and step, between the step's
single host sync and the next step: it must be cheap next to a target forward (microseconds to a
millisecond per row). It sees a request only through the calls below, keyed by the engine's slot.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RowContext:
    """What a host drafter knows of a request at admission."""

    request_id: int  # the engine's id for the request (unique for the engine's lifetime)
    prompt: Sequence[int]  # the prompt's token ids
    prediction: Sequence[int] | None  # token ids of the text the client expects (OpenAI's Predicted Outputs)
    private: bool  # seeded sampled request: draft from its own tokens only, never from other requests'


class HostDrafter(ABC):
    """A model-free drafter. ``k``: its own draft budget per step (vLLM's ``num_speculative_tokens``);
    None takes the engine's K."""

    kind: str = "host"
    k: int | None = None

    def start(self, row: int, ctx: RowContext) -> None:
        """A request entered slot ``row``."""

    @abstractmethod
    def propose(self, row: int, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens`` (the row's prompt then every committed token).
        Fewer, or none, when the drafter has nothing it trusts: the row then verifies fewer."""

    def observe(self, row: int, new_tokens: Sequence[int]) -> None:
        """The step committed ``new_tokens`` to the row (after the acceptance, cut at stops)."""

    def stop(self, row: int, finished: bool) -> None:
        """The request left slot ``row``: ``finished`` normally, or aborted or failed."""
