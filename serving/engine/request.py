"""What a caller hands the engine and gets back: a ``Request``, its ``Completion`` and the
``StepOutput`` of each step (a request's ``Fallback`` rule is in ``serving.engine.fallback``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.engine.fallback import Fallback
from serving.engine.sampling import SamplingParams

__all__ = ["Completion", "Fallback", "Request", "RequestFailed", "StepOutput", "TokenLogprob", "TokenOrigin", "step_origins"]


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    drafter: str | None = None  # a drafter name of the engine; None: "prediction" with a prediction, else the default
    prediction: list[int] | None = None  # token ids of the text the client expects (Predicted Outputs)
    k: int | None = None  # this request's K (num_speculative_tokens), up to the engine's k_max; None: the engine's
    fallback: Fallback | None = None  # switch to the target alone when the drafter stops paying
    expected_acceptance: float | None = None  # predicted accepted / drafted at its K (the router's): step_k's prior
    drafter_priors: dict[str, float] | None = None  # drafter -> predicted per-token acceptance (the router's): auto's prior


@dataclass(frozen=True)
class TokenOrigin:
    """How a generated token came: ``"draft"`` (a draft token the target accepted; ``drafter``
    names who proposed it), ``"correction"`` (the target's token after a rejection), ``"bonus"``
    (the target's extra token after every draft was accepted) or ``"target"`` (a step that
    drafted nothing: the first token after prefill, the target alone)."""

    origin: str
    drafter: str | None = None

    def to_dict(self) -> dict:
        return {"origin": self.origin, "drafter": self.drafter}


TARGET_ORIGIN = TokenOrigin("target")


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability under the target's processed distribution (after the
    request's logits processors, before temperature), with the ``top`` most likely tokens and
    theirs, most likely first (as many as the request's ``logprobs``)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def step_origins(drafter: str, drafted: int, accepted: int, new: int) -> list[TokenOrigin]:
    """The origins of the ``new`` tokens a step committed for a row that drafted ``drafted`` tokens
    with ``drafter`` and had ``accepted`` of them accepted (EOS or the length limit may cut the
    step short: ``new`` <= accepted + 1)."""
    last = TokenOrigin("target" if drafted == 0 else "bonus" if accepted == drafted else "correction")
    return [TokenOrigin("draft", drafter) if i < accepted else last for i in range(new)]


@dataclass
class Completion:
    token_ids: list[int]  # generated tokens, EOS included when one ended the request
    text: str  # decoded without special tokens, cut before a stop string
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: dict
    origins: list[TokenOrigin] | None = None  # [len(token_ids)] how each token came (the engine's own requests)
    logprobs: list[TokenLogprob] | None = None  # [len(token_ids)] when the request asked for logprobs


@dataclass
class StepOutput:
    request_id: int
    new_token_ids: list[int]  # tokens this step committed for the request (stop strings applied)
    finished: Completion | None  # set on the step the request finished
    new_token_origins: list[TokenOrigin] | None = None  # [len(new_token_ids)]
    new_token_logprobs: list[TokenLogprob] | None = None  # [len(new_token_ids)] when the request asked for logprobs


class RequestFailed(RuntimeError):
    """Requests that failed alone: their admission or their row of a step raised. ``errors``:
    request id -> the exception. ``step`` drops them, hands out the other requests' outputs on
    the next call and raises this with their ids in ``request_ids``; the engine goes on."""

    def __init__(self, errors: dict[int, BaseException]) -> None:
        super().__init__(describe_errors(errors))
        self.errors = errors
        self.request_ids = sorted(errors)


def describe_errors(errors: dict[int, BaseException]) -> str:
    return "; ".join(f"request {i}: {type(e).__name__}: {e}" for i, e in sorted(errors.items()))
