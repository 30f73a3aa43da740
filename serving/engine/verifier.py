"""The target side of the engine: what ``SpeculativeEngine`` needs from whatever verifies.

    engine = SpeculativeEngine(target_model, tokenizer, draft)         # a model: wrapped in LocalVerifier
    engine = SpeculativeEngine(LocalVerifier(target_model, tokenizer), tokenizer, draft)   # the same
    engine = SpeculativeEngine(RemoteVerifier("10.0.0.5:50051"), tokenizer, drafters=...)  # serving.distributed

A ``Verifier`` holds the target and what it keeps per row of the engine's static batch (a KV
cache row in this process, a session on a target service). The engine owns everything else: the
decode state (committed tokens, lengths, limits, done), the drafters, every random number and the
requests. Per step it hands the verifier the rows' draft tokens, their q and the step's uniforms;
the verifier answers, per row, how many draft tokens the target accepts and its next token (the
correction or the bonus), and the engine writes that answer into its state with ``commit``, the
same function a target service runs on its own copy of the state.

``LocalVerifier`` is the target in this process: a ``ModelRunner`` over a static KV cache, one
forward over [x_{n-1}, drafts] per step and the acceptance rule (``serving.engine.speculative``).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from serving.engine.models import eos_token_ids
from serving.engine.runner import ModelRunner
from serving.engine.sampling import SamplingParams, SamplingTensors
from serving.engine.speculative import DecodeState, StepLogprobs, StepRandom, accept_logits, first_token, step_logprobs, verify_logits

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from serving.engine.engine_settings import EngineConfig


class VerifierError(RuntimeError):
    """The verifier could not serve some rows (its target went away, or dropped their state).
    ``rows``: the engine's slots that failed; None: every row it holds. The engine drops their
    requests without a completion, hands out what the others produced on the next ``step`` and
    raises this error again from ``step`` with ``request_ids`` naming the failed requests; later
    calls go on (a remote verifier reconnects by itself)."""

    def __init__(self, message: str, rows: list[int] | None = None) -> None:
        super().__init__(message)
        self.rows = rows
        self.request_ids: list[int] = []


@dataclass
class VerifyBatch:
    """One step's rows for the target: the step's batch bucket, B rows, K the step's K bucket."""

    state: DecodeState  # the rows' committed tokens and lengths, before this step (read only)
    params: list[SamplingParams | None]  # [B] each row's sampling settings; None: an empty slot
    sampling: SamplingTensors  # the same settings as per-row tensors
    rand: StepRandom  # the step's uniforms: accept tests [B, K] and the correction/bonus draws [B]
    draft_tokens: torch.Tensor  # [B, K] long
    q: torch.Tensor  # [B, K, V] the distributions the draft tokens were drawn from
    n_draft: torch.Tensor  # [B] long: real draft tokens per row; the rest of K is padding


class Verdict(NamedTuple):
    """The target's answer for every row of a ``VerifyBatch``."""

    n_accepted: torch.Tensor  # [B] long: draft tokens accepted
    next_token: torch.Tensor  # [B] long: the correction (after a rejection) or the bonus token
    failed: VerifierError | None = None  # rows the target could not verify: they commit nothing
    # [B, K+1, n * H] with ``capture``: the target's features at the verified positions (x_{n-1}, then
    # the drafts), of which a row's first n_accepted + 1 are the features of committed tokens.
    features: torch.Tensor | None = None
    logprobs: StepLogprobs | None = None  # when a row asks for them: the committed positions' logprobs


class Verifier(ABC):
    """What the engine needs from the target side. ``bind`` comes first; afterwards ``vocab_size``,
    ``eos_ids`` and ``max_len`` describe the target."""

    name: str = "the target"  # for messages
    vocab_size: int  # the width of p (and of every q)
    eos_ids: list[int]  # the ids that end a request
    max_len: int  # context per row: prompt + new tokens + K + 1
    k_max: int | None = None  # the largest K it verifies; None: any
    device: torch.device | None = None  # where verification reads the state; None: anywhere (the engine's choice)
    # After each ``prefill``: the measured seconds of the prefill it reused instead of computing
    # (``EngineConfig.reuse_prefill``); None when it computed one.
    reused_prefill_s: float | None = None
    # After each ``prefill`` of a request that asks for logprobs: its first token's (else None).
    first_logprobs: StepLogprobs | None = None

    @abstractmethod
    def bind(self, config: EngineConfig) -> None:
        """Take on the engine's static batch (``config.max_batch_size`` rows): fill in
        ``config.max_len`` when it is None and refuse a ``max_len`` the target cannot hold."""

    @abstractmethod
    def prefill(
        self, row: int, prompt: torch.Tensor, params: SamplingParams, u: torch.Tensor, *, max_new_tokens: int, k_max: int
    ) -> int | None:
        """Prefill ``prompt`` ([1, L] long) into ``row`` and return the request's first token, drawn
        with uniform ``u`` ([1]) under ``params``; None if the target has no room for it now (the
        engine retries on a later step). ``k_max``: the largest K the request may verify (0: the
        target alone). Raises ``VerifierError`` when the target cannot be reached."""

    @abstractmethod
    def verify(self, batch: VerifyBatch) -> Verdict:
        """One verification of every row of ``batch`` (rows whose ``params`` is None are empty).
        Does not change ``batch.state``: the engine commits the verdict. Raises ``VerifierError``
        when no row could be verified; rows that failed alone are in ``Verdict.failed``."""

    @abstractmethod
    def release(self, row: int) -> None:
        """``row``'s request left (finished, aborted or failed): drop what is held for it."""

    def forget(self, row: int) -> None:
        """``row``'s admission failed after its prefill: the row's cache no longer describes a
        prompt that later requests may reuse (``EngineConfig.reuse_prefill``)."""

    def close(self) -> None:
        """Free what the verifier holds (connections); the engine is not used afterwards."""

    def capture(self, layers: tuple[int, ...]) -> None:
        """Hand out the target's features of ``layers`` (the residual stream entering each, as
        ``ModelRunner.capture_layers``): the prompt's after each ``prefill`` (``prompt_features``)
        and the verified positions' in each ``Verdict``. For drafters that read them (EAGLE-3)."""
        raise ValueError(f"{self.name} does not hand out the target's hidden states (layers {list(layers)}): "
                         "run a drafter that reads them (eagle3) beside a local target, not on a draft node")

    prompt_features: torch.Tensor | None = None  # [L, n * H] the last prefill's, with capture

    def compile(self, backend: str, shapes: int) -> None:
        """Compile the target's verify forwards with ``backend`` (``shapes``: how many input shapes
        the engine's runners compile together). A remote target compiles on its own side."""

    def warmup(self, widths: tuple[int, ...], rows: int) -> None:
        """Run every verify width once at batch size ``rows`` (compiled shapes pay their cost now)."""

    def use_cuda_graphs(self) -> None:
        """Replay the verify forwards as CUDA graphs (``ModelRunner.use_cuda_graphs``). A remote
        target decides that on its own side."""


class LocalVerifier(Verifier):
    """The target in this process: a ``ModelRunner`` (the model bound to a static KV cache with a
    row per slot of the engine), verified with ``verify_tokens`` on the engine's own decode state."""

    name = "the local target"

    def __init__(self, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.model = target
        self.tokenizer = tokenizer  # a grammar's first token is masked with it
        self.eos_ids = eos_token_ids(target, tokenizer)
        self.max_position_embeddings = getattr(target.config, "max_position_embeddings", None) or 2048
        self.runner: ModelRunner | None = None  # built by bind, for the engine's batch
        self.reuse = False
        # row -> (prompt [1, L], logits after it [1, 1, V], seconds the prefill took): what the row
        # holds, for ``reuse_prefill``. Only prefills write a row's cache at positions below its
        # prompt's end: a step writes at lengths - 1 and after, a done row's too, so the row keeps
        # that prompt's KV until the next prefill into it (or a warm-up, which forgets them all).
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}

    def bind(self, config: EngineConfig) -> None:
        if config.max_len is None:
            config.max_len = min(2048, self.max_position_embeddings)
        if config.max_len > self.max_position_embeddings:
            raise ValueError(f"max_len={config.max_len} exceeds the target's max_position_embeddings="
                             f"{self.max_position_embeddings}")  # fmt: skip
        self.runner = ModelRunner(self.model, batch_size=config.max_batch_size, max_len=config.max_len)
        self.reuse, self._kept = config.reuse_prefill, {}
        self.max_len, self.vocab_size, self.device = config.max_len, self.runner.vocab_size, self.runner.device

    def prefill(
        self, row: int, prompt: torch.Tensor, params: SamplingParams, u: torch.Tensor, *, max_new_tokens: int, k_max: int
    ) -> int:
        kept = self._kept.get(row) if self.reuse else None
        if kept is not None and kept[0].shape == prompt.shape and torch.equal(kept[0], prompt):
            self.reused_prefill_s = kept[2]
            first, self.first_logprobs = first_token(kept[1], params, u, prompt[0].tolist(), self.tokenizer)
            return first
        self.reused_prefill_s = None
        self._kept.pop(row, None)  # a prefill that fails midway leaves the row holding neither prompt
        started = time.perf_counter()
        logits = self.runner.prefill(prompt, row)  # [1, 1, V]
        if self.runner.capture:
            self.prompt_features = self.runner.prefill_features[0]  # [L, n * H]
        first, self.first_logprobs = first_token(logits, params, u, prompt[0].tolist(), self.tokenizer)  # int(): it has finished
        if self.reuse:
            # Copies: a compiled forward may hand out the same output buffer again on its next call.
            self._kept[row] = (prompt.clone(), logits.clone(), time.perf_counter() - started)
        return first

    def verify(self, batch: VerifyBatch) -> Verdict:
        s = batch.sampling
        logits = verify_logits(self.runner, batch.state, s, batch.draft_tokens, batch.n_draft)  # [B, K+1, V]
        n_accepted, next_token = accept_logits(logits, s, batch.rand, batch.draft_tokens, batch.q, batch.n_draft)
        logprobs = None if s.logprobs is None else step_logprobs(logits, batch.draft_tokens, n_accepted, next_token, s.logprobs)
        return Verdict(n_accepted, next_token, features=self.runner.last_features if self.runner.capture else None,
                       logprobs=logprobs)  # fmt: skip

    def capture(self, layers: tuple[int, ...]) -> None:
        self.runner.capture_layers(layers)
        self.reuse, self._kept = False, {}  # a reused prefill would hand out no features

    def release(self, row: int) -> None:
        """Nothing to drop: the next request in ``row`` prefills over the cache row (or reuses it)."""

    def forget(self, row: int) -> None:
        # The failed request never reached the decode state, so the row keeps its previous
        # occupant's length, and frozen steps write there, which may be inside this prompt.
        self._kept.pop(row, None)

    def compile(self, backend: str, shapes: int) -> None:
        self.runner.compile(backend, shapes=shapes)
        self._kept.clear()  # logits of the eager forward are not the compiled forward's, bit for bit

    def use_cuda_graphs(self) -> None:
        self.runner.use_cuda_graphs()
        self._kept.clear()

    def warmup(self, widths: tuple[int, ...], rows: int) -> None:
        self._kept.clear()  # it writes every row from position 0
        self.runner.warmup(widths, rows=rows)
