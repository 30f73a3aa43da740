"""The draft side of distributed serving: ``SpeculativeEngine`` with the target behind gRPC.

    engine = RemoteSpeculativeEngine(draft, tokenizer, "10.0.0.5:50051", EngineConfig(max_batch_size=8, k=4))
    [out] = engine.generate([Request(tokenizer.encode("def add(a, b):"), max_new_tokens=32)])

Same incremental API as ``SpeculativeEngine`` (it is one: only the model-facing hooks differ).
Each request is a session on the target (serving/distributed/verify.proto): admission opens it (the target
prefills and draws the first token), every step drafts locally with ``draft_half`` and sends one
Verify call for all running rows; the answer (accepted count + correction or bonus token per row)
is applied to the local state with the same ``commit`` the target ran. Uniforms come from each
request's seeded generator on this node, so output equals the fused engine's.

If the target cannot be reached, or lost sessions (restart, idle eviction), ``step`` raises
``TargetUnavailable`` naming the failed request ids; they are gone from the engine, the other
requests keep going, and later calls reconnect by themselves.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Mapping

import grpc
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from serving.distributed import verify_pb2, verify_pb2_grpc
from serving.distributed.verify_service import MESSAGE_OPTIONS
from serving.engine.core import EngineConfig, Request, SpeculativeEngine, StepOutput, _Slot
from serving.engine.sampling import SamplingTensors
from serving.engine.speculative import DecodeState, StepRandom, commit

# The call never reached a working target (or its answer never came back): reconnect next time.
_CONNECTION_LOST = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}


class TargetUnavailable(RuntimeError):
    """The target service could not serve some requests; ``request_ids`` are finished (failed)."""

    def __init__(self, message: str, address: str, request_ids: list[int] | None = None) -> None:
        super().__init__(message)
        self.address = address
        self.request_ids = list(request_ids or [])


class RemoteSpeculativeEngine(SpeculativeEngine):
    def __init__(
        self,
        draft: PreTrainedModel | None,
        tokenizer: PreTrainedTokenizerBase,
        target_address: str,
        config: EngineConfig | None = None,
        timeout_s: float = 30.0,
        *,
        default_drafter: str | None = None,
    ) -> None:
        """Connects to the target at ``target_address`` (HOST:PORT), waiting up to ``timeout_s``
        for it to come up; ``timeout_s`` is also the deadline of every later call. ``draft``: one
        draft model, or a mapping of named drafters as ``SpeculativeEngine``'s ``drafters``."""
        config = config or EngineConfig()
        self.address = target_address
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._stub: verify_pb2_grpc.VerifierStub | None = None
        self._closing: list[grpc.Future] = []
        try:
            info = self._call("Info", verify_pb2.InfoRequest(), wait_for_ready=True)
        except TargetUnavailable as e:
            raise TargetUnavailable(
                f"{e} Start it first (`serve --role target`) or fix the address (--target HOST:PORT).", self.address
            ) from e.__cause__
        self.target_info = info
        self._instance = info.instance_id
        if config.max_len is None:
            config.max_len = info.max_len
        if config.max_len > info.max_len:  # the target's context per session is the limit
            raise ValueError(f"max_len={config.max_len} exceeds the target's max_len={info.max_len} at {target_address}")
        drafters = draft if isinstance(draft, Mapping) else ({"draft": draft} if draft is not None else {})
        if any(d is not None for d in drafters.values()) and config.k != 0 and config.k_max > info.k_max:
            raise ValueError(f"k up to {config.k_max} but the target at {target_address} verifies K <= {info.k_max}")
        models = [d for d in drafters.values() if isinstance(d, torch.nn.Module)]
        device = next(models[0].parameters()).device if models else torch.device("cpu")
        self.target = None  # the target lives behind self.address
        self._sessions: list[str | None] = [None] * config.max_batch_size
        self._carry: list[StepOutput] = []  # outputs of a step that raised, handed out next step
        self._lost: dict[int, str] = {}  # slot -> why the target dropped its session this step
        # (round trip, time the target spent on it) in seconds, of recent Verify calls.
        self.verify_times: deque[tuple[float, float]] = deque(maxlen=4096)
        # One batch bucket: the target's sessions are per slot, and its own batch is what it verifies.
        config.batch_buckets = (config.max_batch_size,)
        self._setup(tokenizer, drafters, config, info.vocab_size, list(info.eos_ids), device, default_drafter)

    # ---- public API: SpeculativeEngine's, plus failure handling -------------------------------

    def step(self) -> list[StepOutput]:
        outputs, self._carry = self._carry, []
        try:
            self._advance(outputs)
        except TargetUnavailable as e:
            # The target is gone: every running request on it failed with this one.
            failed = e.request_ids + self._fail([b for b, s in enumerate(self._slots) if s is not None])
            self._carry = [o for o in outputs if o.request_id not in failed]
            raise TargetUnavailable(
                f"{e} {len(failed)} request(s) failed; start the target with `serve --role target` or check "
                f"--target {self.address}. This node reconnects by itself: new requests succeed once it is back.",
                self.address,
                failed,
            ) from e.__cause__
        if self._lost:
            lost, self._lost = self._lost, {}
            reasons = sorted(set(lost.values()))
            failed = self._fail(list(lost))
            self._carry = [o for o in outputs if o.request_id not in failed]
            raise TargetUnavailable(
                f"target {self.address} no longer holds the session of {len(failed)} request(s), which failed: "
                f"{'; '.join(reasons)}. New requests open fresh sessions.",
                self.address,
                failed,
            )
        return outputs

    def has_unfinished_requests(self) -> bool:
        # Outputs carried over from a step that raised (possibly a Finished one) still need a step
        # to be handed out, even when no slot is running any more.
        return bool(self._carry) or super().has_unfinished_requests()

    def close(self) -> None:
        """Abort everything and close the channel."""
        for b, slot in enumerate(self._slots):
            if slot is not None:
                self.abort_request(slot.index)
        self._waiting.clear()
        self._reset_channel()

    # ---- hooks ---------------------------------------------------------------------------------

    def _admit(self, b: int, index: int, request: Request) -> tuple[_Slot, bool] | None:
        try:
            return super()._admit(b, index, request)
        except TargetUnavailable as e:
            e.request_ids.append(index)
            raise

    def _prefill_target(self, b: int, request: Request, prompt: torch.Tensor, u: torch.Tensor) -> int | None:
        p = request.params
        session_id = uuid.uuid4().hex
        call = verify_pb2.OpenRequest(
            session_id=session_id, prompt_ids=request.prompt_ids, max_new_tokens=request.max_new_tokens,
            sampling=verify_pb2.Sampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p),
            k_max=self.config.k_max if self.drafting else 0, u_first=float(u[0]),
        )  # fmt: skip
        try:
            reply = self._call("Open", call)
        except TargetUnavailable as e:
            if e.__cause__ is not None and e.__cause__.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return None  # every target slot is taken (other draft nodes): wait for one
            raise
        self._sessions[b] = session_id
        self._instance = reply.instance_id
        return reply.first_token

    def _verify(
        self,
        slots: list[_Slot | None],
        state: DecodeState,  # the whole batch: a remote engine runs one bucket, all its slots
        sampling: SamplingTensors,
        rand: StepRandom,
        draft_tokens: torch.Tensor,  # [B, K]
        q: torch.Tensor,  # [B, K, V]
        n_draft: torch.Tensor,  # [B]
        clock,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.state
        B, k = draft_tokens.shape
        live = [b for b, slot in enumerate(slots) if slot is not None]
        n = s.lengths.cpu()  # [B]
        last = s.tokens.gather(1, (s.lengths - 1).unsqueeze(1)).squeeze(1).tolist()  # [B] x_{n-1}
        drafts, u_accept, u_next = draft_tokens.tolist(), rand.accept[:, :k].tolist(), rand.next.tolist()
        counts = n_draft.tolist()  # [B]
        q = q.to("cpu", torch.float32).contiguous()  # [B, K, V]
        # Each item carries only its row's real draft tokens; the target pads the rest of K.
        items = [
            verify_pb2.VerifyItem(
                session_id=self._sessions[b], length=int(n[b]), pending=[last[b]], draft_tokens=drafts[b][: counts[b]],
                # Greedy q is one-hot at the draft token: the target rebuilds it, nothing to send.
                q=b"" if counts[b] == 0 or slots[b].request.params.greedy else q[b, : counts[b]].numpy().tobytes(),
                u_accept=u_accept[b][: counts[b]], u_next=u_next[b],
            )  # fmt: skip
            for b in live
        ]
        sent = time.perf_counter()
        reply = self._call("Verify", verify_pb2.VerifyRequest(k=k, items=items))
        self.verify_times.append((time.perf_counter() - sent, reply.target_ms / 1e3))
        clock("target")
        n_acc = torch.zeros(B, dtype=torch.long)
        next_token = torch.zeros(B, dtype=torch.long)
        target_done = {}
        for b, r in zip(live, reply.results):
            if r.error:
                self._lost[b] = r.error
            else:
                n_acc[b], next_token[b], target_done[b] = r.n_accepted, r.next_token, r.done
        frozen = s.done.clone()
        for b in self._lost:  # a lost row commits nothing; step() fails its request
            s.done[b] = True
        n_new = commit(s, draft_tokens, n_acc.to(s.done.device), next_token.to(s.done.device))
        for b in self._lost:
            s.done[b] = frozen[b]
        done = s.done.tolist()
        for b, d in target_done.items():
            if d != done[b]:  # both ran the same commit: a mismatch means a broken protocol peer
                self._lost[b] = f"target and draft node disagree on whether the request ended (target: {d})"
        return n_acc, n_new

    def _release(self, b: int) -> None:
        session_id, self._sessions[b] = self._sessions[b], None
        if session_id is None or self._stub is None:
            return
        self._closing = [f for f in self._closing if not f.done()]
        # Fire and forget (kept referenced so it is not cancelled); an idle session is evicted anyway.
        self._closing.append(
            self._stub.Close.future(verify_pb2.CloseRequest(session_ids=[session_id]), timeout=self.timeout_s)
        )

    # ---- connection ----------------------------------------------------------------------------

    def _fail(self, rows: list[int]) -> list[int]:
        """Drop the requests in ``rows`` without finishing them; returns their ids."""
        ids = []
        for b in rows:
            slot = self._slots[b]
            if slot is None:
                continue
            ids.append(slot.index)
            self._slots[b] = None
            self.state.done[b] = True
            self._sessions[b] = None  # lost with the target, or evicted there
        self._sampling = None
        return ids

    def _call(self, method: str, request, wait_for_ready: bool = False):
        if self._stub is None:
            self._channel = grpc.insecure_channel(self.address, options=MESSAGE_OPTIONS)
            self._stub = verify_pb2_grpc.VerifierStub(self._channel)
        started = time.perf_counter()
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s, wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            code = e.code()
            if code in _CONNECTION_LOST:
                # A fresh channel next time: gRPC's own reconnect backoff can stretch to minutes.
                self._reset_channel()
                what = f"cannot be reached ({code.name} after {time.perf_counter() - started:.1f} s: {e.details()})"
            else:
                what = f"refused {method} ({code.name}: {e.details()})"
            raise TargetUnavailable(f"target {self.address} {what}.", self.address) from e

    def _reset_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None
        self._closing = []
