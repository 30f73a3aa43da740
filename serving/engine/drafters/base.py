"""The drafter protocol: what proposes a request's next tokens before the target checks them.

A drafter proposes up to K tokens for a row, with the distributions q they were drawn from. One
engine runs any mix of drafters in one batch, each over its own rows:

* A **host** drafter (``HostDrafter``: ``ngram``, ``suffix``, ``prediction``) reads the request's
  tokens on the host and proposes tokens without a model. Its proposal is a point mass, q =
  one-hot at each token, so the acceptance rule (``serving.engine.acceptance``) accepts token x
  with probability min(1, p(x)) and on rejection draws from norm(max(0, p - q)): the target's own
  distribution with x taken out. The output follows p exactly, sampled or greedy, whatever the
  drafter proposes; a proposal only changes how many tokens a target call yields.
* A **batch** drafter (``BatchDrafter``: the draft model, ``serving.engine.drafters.model``) runs
  on the device over all its rows at once, as the first half of the speculative step, and gives q
  from its logits under each request's sampling settings.

* A **routing** drafter (``RoutingDrafter``: ``auto``, ``serving.engine.drafters.auto``) drafts
  with the engine's other drafters, choosing one per row and step (``choose``); the engine routes
  the row to that drafter for the step and reports the verdict (``settle``).

``none`` (the target alone) is the absence of a drafter: its rows verify one token per step.

Life cycle, keyed by the engine's slot (``row``), all on the engine's thread:

    bind(...)                        once, when the engine is built (a batch drafter sizes its cache)
    start(row, ctx)                  a request entered the slot (a draft model prefills its prompt)
    propose(row, tokens, k)          host: up to k tokens, per row and step
    propose_rows(batch) -> Proposal  batch: every row of this drafter at once
    choose(row, tokens, k) -> Choice routing: the drafter (and K, and a host's tokens) of this step
    settle(row, drafted, accepted)   routing: how its choice fared
    observe(row, new_tokens, hidden) what the target committed to the row, every step, proposed or not
    stop(row, finished)              the request left the slot (finished, aborted, failed, fell back)

The contract (``tests/test_drafter_conformance.py`` checks it for every registered kind):

* **What a drafter reads.** Its rows' committed tokens (``propose``'s ``tokens``, the decode
  state of ``DraftBatch``), the request's sampling settings and uniforms (``DraftBatch.sampling``,
  ``DraftBatch.rand``: draft tokens are drawn with ``rand.draft``, never the acceptance uniforms),
  the target's features when it declares ``target_layers``, and what ``start`` gave it. Never
  another row's tokens, unless the row is not ``private`` (``suffix``'s cross-request cache).
* **What it returns.** At most the row's budget of tokens per row (``k``, ``DraftBatch.budgets``:
  a row beside a row of larger K still drafts its own), fewer or none when unsure; and q, the
  distribution each token was drawn from (a host drafter's q is the point mass at its token).
* **State is committed by ``observe``.** What a drafter changes while proposing (``propose``,
  ``propose_rows``, ``choose``) is provisional: the step may still fail (a neighbour row raises
  and the engine re-runs each row alone from its committed state) and the drafter is then asked
  again for the same tokens. So a proposal reads committed state only, and what it would change
  is applied when ``observe`` reports the step's tokens; a later proposal for the row replaces a
  provisional change never observed. (A change that a repeated call makes again identically, like
  reading committed tokens into a cache, may be made at once.)
* **Capabilities are declared, not inferred.** ``host`` (proposes on the host from the row's
  tokens alone: asked first, so a goodput cap prices what it proposed), ``owns_rows`` (holds
  per-row device state, a KV cache: its forwards are timed as draft cost), ``routes`` (drafts
  with the engine's other drafters, ``choose``), ``target_layers`` (reads the target's features).
  The engine asks these; it never switches on a drafter's class.

A drafter that reads the target's own features (EAGLE-3) names the layers in ``target_layers``
(vLLM's ``eagle_aux_hidden_state_layer_ids``: the residual stream entering each layer); the
verifier then hands them to ``start`` (``RowContext.hidden``: every prompt position) and to
``observe(row, new_tokens, hidden=...)``: the feature of position p comes with token p + 1, so a
step that commits m tokens hands over the features of the m positions before them (other
drafters get ``hidden=None``). A host drafter must be cheap next to a target forward
(microseconds to a millisecond per row).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

NONE = "none"  # the drafter name of the target alone
PREDICTION = "prediction"  # the built-in drafter of requests that carry a prediction


@dataclass(frozen=True)
class RowContext:
    """What a drafter knows of a request at admission."""

    request_id: int  # the engine's id for the request (unique for the engine's lifetime)
    prompt: Sequence[int]  # the prompt's token ids
    prediction: Sequence[int] | None  # token ids of the text the client expects (OpenAI's Predicted Outputs)
    private: bool  # seeded sampled request: draft from its own tokens only, never from other requests'
    hidden: torch.Tensor | None = None  # [L, len(target_layers) * H] the target's features, for drafters that ask


@dataclass
class DraftBatch:
    """What a batch drafter drafts from in one step. ``budgets[b]``: the K of engine row b (0: the
    row is not this drafter's, or drafts nothing this step)."""

    budgets: list[int]  # [B] per engine row
    state: Any  # serving.engine.speculative.DecodeState, all B rows
    sampling: Any  # serving.engine.sampling.SamplingTensors, all B rows
    rand: Any  # serving.engine.speculative.StepRandom, all B rows
    vocab_size: int
    batch_buckets: tuple[int, ...]  # the batch sizes a forward may run at (compiled shapes)
    draft_confidence: float | None = None  # stop a row's drafting below this top probability
    draft_stop: str = "token"  # "token" or "cumulative" (see draft_half)
    k_max: int = 0  # the engine's largest K (a drafter's fixed first-forward width is k_max + 1); 0: unknown


@dataclass
class Proposal:
    """A batch drafter's proposal over the engine's B rows (rows not its own: ``n`` 0)."""

    tokens: torch.Tensor  # [B, K] long
    q: torch.Tensor  # [B, K, V] the distributions the tokens were drawn from
    n: torch.Tensor  # [B] long: real draft tokens per row, the rest of K is padding
    confidence: torch.Tensor | None = None  # [B, K] the drafter's probability q(x) of each proposed x (None: not given)
    forwards: int = 0  # device forwards it ran (what the engine times as draft cost)


@dataclass(frozen=True)
class Choice:
    """A routing drafter's choice for one row and step: ``drafter`` (None: the target alone), the
    K it may propose, and a host drafter's proposal (already made, cut to ``k``)."""

    drafter: str | None
    k: int
    tokens: list[int] | None = None


class Drafter(ABC):
    """What every drafter has. ``k``: its own draft budget per step (vLLM's ``num_speculative_tokens``);
    None takes the engine's K. ``target_layers``: target layers whose hidden states it reads."""

    kind: str = "drafter"
    k: int | None = None
    target_layers: tuple[int, ...] = ()
    # Capabilities (see the module docstring): what the engine asks instead of the drafter's class.
    host: bool = False  # proposes on the host from the row's tokens alone (q: point masses)
    owns_rows: bool = False  # holds per-row device state (a KV cache); its forwards are draft cost
    routes: bool = False  # drafts with the engine's other drafters, one per row and step (choose)
    device: torch.device | None = None  # where its forwards run (None: the host)

    def bind(self, *, batch_size: int, max_len: int, vocab_size: int) -> None:
        """The engine that holds this drafter was built with these shapes."""

    def start(self, row: int, ctx: RowContext) -> None:
        """A request entered slot ``row``."""

    def observe(self, row: int, new_tokens: Sequence[int], hidden: torch.Tensor | None = None) -> None:
        """The step committed ``new_tokens`` to the row (after the acceptance, cut at stops): the
        moment a proposal's provisional state becomes the row's. ``hidden`` (drafters with
        ``target_layers``, else None): [len(new_tokens), len(target_layers) * H], the target's
        features at the positions before those tokens."""

    def stop(self, row: int, finished: bool) -> None:
        """The request left slot ``row``: ``finished`` normally, or aborted, failed or fell back."""

    # Compiled shapes: a drafter that runs device forwards compiles and warms them up with the engine.
    def compile(self, backend: str, shapes: int) -> None:
        """Compile its forwards (``shapes``: the graphs torch may keep)."""

    def use_cuda_graphs(self) -> None:
        """Capture its step shapes as CUDA graphs at the next warm-up."""

    def warmup(self, rows: int, widths: tuple[int, ...] = (1, 2)) -> None:
        """Run each of its step shapes once at batch size ``rows``."""

    @property
    def forward_shapes(self) -> int:
        """Compiled forward widths it uses per batch bucket (0 for a host drafter)."""
        return 0


class HostDrafter(Drafter):
    """A model-free drafter, proposing on the host for one row at a time."""

    kind = "host"
    host = True

    @abstractmethod
    def propose(self, row: int, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``tokens`` (the row's prompt then every committed token).
        Fewer, or none, when the drafter has nothing it trusts: the row then verifies fewer."""


class BatchDrafter(Drafter):
    """A drafter that proposes for all its rows at once on the device."""

    kind = "batch"
    owns_rows = True

    @abstractmethod
    def propose_rows(self, batch: DraftBatch) -> Proposal | None:
        """Its rows' proposals, or None when none of its rows drafts this step."""


class RoutingDrafter(Drafter):
    """A drafter that drafts with the engine's other drafters, one per row and step."""

    kind = "routing"
    routes = True

    @abstractmethod
    def attach(self, drafters: Mapping[str, Drafter]) -> None:
        """The engine's drafters by name (this one among them), before ``bind``."""

    @abstractmethod
    def price(self, costs: Any, widths: Sequence[int]) -> None:
        """The engine's measured step costs (``serving.engine.goodput.RowCosts``, batch 1) and
        verify widths, once, before the first request."""

    @property
    def model_costs_needed(self) -> tuple[str, ...]:
        """Names of the model drafters whose forwards ``price`` needs timed."""
        return ()

    @abstractmethod
    def choose(self, row: int, tokens: Sequence[int], k: int, prior: Mapping[str, float] | None = None) -> Choice:
        """This step's drafter for the row (``tokens``: prompt and every committed token; ``k``: the
        row's budget; ``prior``: the request's per-drafter acceptance priors, if it has some)."""

    def settle(self, row: int, drafted: int, accepted: int) -> None:
        """The step verified ``drafted`` tokens of the row's choice and accepted ``accepted``."""
