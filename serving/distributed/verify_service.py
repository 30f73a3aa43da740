"""The target side of distributed serving: a gRPC service that verifies draft tokens.

    server = VerifyServer(target_model, tokenizer, max_batch_size=8)
    port = server.start()          # then draft nodes connect to HOST:port (serving.distributed.remote.RemoteVerifier)
    server.stop()

or, blocking, as ``serve --role target`` runs it: ``serve_target("path/or/hub-id", port=50051)``.

The target model sits in a ``ModelRunner`` with a static batch of slots. Each session (one request
on one draft node, see serving/distributed/verify.proto) owns a slot, its KV cache and its row of a
``DecodeState`` from Open until Close, or until it has been idle for ``session_timeout_s``.

One worker thread owns the model. gRPC handler threads queue their call and wait; the worker
takes a Verify call, keeps collecting for up to ``batch_window_ms`` (or until every open session
has a call waiting), groups the sessions by K and runs one ``verify_half`` per group over the whole
static batch, the same function the fused engine runs. Slots not in the group are frozen (marked
done for the call): their rows still go through the forward, which only rewrites their KV at
positions the session itself rewrites before reading, so a session's result does not depend on
who else is in the batch, bitwise so with the CPU kernels (serving.engine.cpu_kernels).
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import grpc
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from serving.distributed import SESSION_TIMEOUT_S, verify_pb2, verify_pb2_grpc
from serving.engine.models import eos_token_ids
from serving.engine.runner import ModelRunner
from serving.engine.sampling import SamplingParams, SamplingTensors
from serving.engine.speculative import DecodeState, StepRandom, prefill_first_token, start_row, verify_half

if TYPE_CHECKING:
    from serving.engine.engine_settings import EngineSettings

log = logging.getLogger(__name__)

# q for a batch of a large vocabulary is tens of MB (8 x 4 x 152k floats); gRPC's default is 4 MB.
# A draft node may send that much; the target accepts what its largest legitimate verify needs.
MESSAGE_OPTIONS = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]


def max_verify_bytes(max_batch_size: int, k_max: int, vocab_size: int, max_len: int) -> int:
    """The largest message a legitimate draft node sends: a Verify of every slot at the largest K
    with sampled rows' q ([B, K, V] float32), or an Open with the longest prompt; plus slack for the
    per-item fields."""
    return max(max_batch_size * k_max * vocab_size * 4, max_len * 10) + (1 << 20)


class TokenCheck(grpc.ServerInterceptor):
    """Every call must carry ``authorization: Bearer TOKEN`` metadata (a shared secret between the
    target and its draft nodes); others are refused UNAUTHENTICATED with one log line."""

    def __init__(self, tokens: str | dict[str, str]) -> None:
        """``tokens``: the shared token, or node name -> that node's own token."""
        tokens = {SHARED_NODE: tokens} if isinstance(tokens, str) else tokens
        self._expected = [f"Bearer {t}".encode() for t in tokens.values()]

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token: set grpc.token (or "
                                                           "CHORAL_GRPC_TOKEN) to the target's token")  # fmt: skip

        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation, handler_call_details):
        got = dict(handler_call_details.invocation_metadata).get("authorization", "")
        got = got.encode() if isinstance(got, str) else got
        if any([hmac.compare_digest(got, expected) for expected in self._expected]):  # all compared: no timing hint
            return continuation(handler_call_details)
        log.warning("refused %s: missing or wrong token", handler_call_details.method)
        return self._refuse


class _CallError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


SHARED_NODE = "shared"  # the one identity of every caller when the target has no per-node tokens


def node_of(metadata, nodes: dict[str, str]) -> str:
    """The draft node a call comes from: the name whose token it carries (``TokenCheck`` has
    already refused any other); every caller is ``SHARED_NODE`` without per-node tokens."""
    got = dict(metadata or ()).get("authorization", "")
    got = got.encode() if isinstance(got, str) else got
    for name, token in nodes.items():
        if hmac.compare_digest(got, f"Bearer {token}".encode()):  # bytes: str compares only ASCII
            return name
    return SHARED_NODE


@dataclass
class _Job:
    kind: str  # "open" | "verify" | "close"
    request: object
    node: str = SHARED_NODE
    received: float = field(default_factory=time.perf_counter)
    future: futures.Future = field(default_factory=futures.Future)


@dataclass
class _Session:
    slot: int
    params: SamplingParams
    k_max: int
    last_used: float
    node: str = SHARED_NODE


class VerifyService(verify_pb2_grpc.VerifierServicer):
    """The servicer plus its batching worker; ``VerifyServer`` wires it to a gRPC server."""

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        name: str = "target",
        max_batch_size: int = 8,
        max_len: int | None = None,
        k_max: int = 8,
        session_timeout_s: float = SESSION_TIMEOUT_S,
        batch_window_ms: float = 2.0,
        nodes: dict[str, str] | None = None,
        max_sessions_per_node: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``nodes``: draft node name -> its token, so that calls are told apart by node;
        ``max_sessions_per_node``: the most sessions one node may hold at once (default: the slots
        shared evenly among ``nodes``; all of them without), so that no node can take every slot.
        ``clock``: what a session's idle time is measured on (a test passes a clock it moves)."""
        max_pos = getattr(target.config, "max_position_embeddings", None) or 2048
        max_len = max_len or min(2048, max_pos)
        if max_len > max_pos:
            raise ValueError(f"max_len={max_len} exceeds the target's max_position_embeddings={max_pos}")
        if max_batch_size < 1 or k_max < 1:
            raise ValueError(f"max_batch_size={max_batch_size} and k_max={k_max} must be >= 1")
        self.name, self.max_len, self.k_max, self.max_pos = name, max_len, k_max, max_pos
        self.session_timeout_s, self.batch_window_s, self.clock = session_timeout_s, batch_window_ms / 1e3, clock
        self.B = max_batch_size
        self.nodes = dict(nodes or {})
        if max_sessions_per_node is None:
            max_sessions_per_node = max(1, -(-max_batch_size // len(self.nodes))) if self.nodes else max_batch_size
        if max_sessions_per_node < 1:
            raise ValueError(f"max_sessions_per_node={max_sessions_per_node} must be >= 1")
        self.max_sessions_per_node = max_sessions_per_node
        self.runner = ModelRunner(target, batch_size=max_batch_size, max_len=max_len)
        self.vocab_size = self.runner.vocab_size
        self.device = self.runner.device
        self.eos_ids = eos_token_ids(target, tokenizer)
        B = max_batch_size
        self.state = DecodeState(
            tokens=torch.zeros(B, max_len + k_max + 1, dtype=torch.long, device=self.device),
            lengths=torch.full((B,), 2, dtype=torch.long, device=self.device),  # empty slots: done 2-token rows
            limits=torch.full((B,), 2, dtype=torch.long, device=self.device),
            done=torch.ones(B, dtype=torch.bool, device=self.device),
            eos_ids=torch.tensor(self.eos_ids, dtype=torch.long, device=self.device),
        )
        self.instance_id = uuid.uuid4().hex
        self.sessions: dict[str, _Session] = {}
        self._free = list(range(B - 1, -1, -1))
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._stopping = threading.Event()
        self._worker: threading.Thread | None = None
        self.forwards = 0  # verify forwards run, for tests and logs
        self.max_calls_per_forward = 0  # most Verify calls (draft-node steps) one forward served

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._worker = threading.Thread(target=self._loop, name="choral-verify", daemon=True)
        self._worker.start()

    def stop(self) -> None:
        """Finish the batch in hand, then fail every queued call with UNAVAILABLE."""
        self._stopping.set()
        if self._worker is not None:
            self._worker.join()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            job.future.set_exception(_CallError(grpc.StatusCode.UNAVAILABLE, "the target is shutting down"))

    # ---- RPC handlers (gRPC threads) -----------------------------------------------------------

    def Info(self, request, context):
        return verify_pb2.InfoReply(
            # A folder's name, never the host's path.
            model=os.path.basename(os.path.normpath(self.name)), vocab_size=self.vocab_size, eos_ids=self.eos_ids, max_len=self.max_len,
            k_max=self.k_max, max_batch_size=self.B, instance_id=self.instance_id,
            max_position_embeddings=self.max_pos,
        )  # fmt: skip

    def Open(self, request, context):
        return self._submit("open", request, context)

    def Verify(self, request, context):
        return self._submit("verify", request, context)

    def Close(self, request, context):
        return self._submit("close", request, context)

    def _submit(self, kind: str, request, context):
        if self._stopping.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the target is shutting down")
        job = _Job(kind, request, node_of(context.invocation_metadata(), self.nodes) if self.nodes else SHARED_NODE)
        self._jobs.put(job)
        while True:
            try:
                return job.future.result(timeout=0.25)
            except _CallError as e:
                context.abort(e.code, e.message)
            except futures.TimeoutError:
                # A call queued just as the worker stopped would otherwise wait forever.
                if self._stopping.is_set() and not (self._worker and self._worker.is_alive()):
                    context.abort(grpc.StatusCode.UNAVAILABLE, "the target is shutting down")

    # ---- the worker ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self._jobs.get(timeout=0.05)
            except queue.Empty:
                self._evict_idle()
                continue
            batch = [job]
            if job.kind == "verify":
                self._collect(batch)
            self._evict_idle()
            verifies = []
            for j in batch:  # Open/Close in arrival order first; a Verify never waits on them
                if j.kind == "verify":
                    verifies.append(j)
                    continue
                try:
                    j.future.set_result(self._open(j.request, j.node) if j.kind == "open" else self._close(j.request))
                except _CallError as e:
                    j.future.set_exception(e)
                except Exception as e:  # a bug must not kill the worker: report it to the caller
                    log.exception("%s failed", j.kind)
                    j.future.set_exception(_CallError(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"))
            if verifies:
                try:
                    self._verify(verifies)
                except Exception as e:
                    log.exception("verify failed")
                    for j in verifies:
                        if not j.future.done():
                            j.future.set_exception(_CallError(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"))

    def _collect(self, batch: list[_Job]) -> None:
        """Wait up to the batch window for more calls, unless every open session already has one
        waiting (then nobody else can join) or the batch is full."""
        rows = len(batch[0].request.items)
        deadline = time.perf_counter() + self.batch_window_s
        while rows < min(len(self.sessions), self.B):
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                job = self._jobs.get(timeout=left)
            except queue.Empty:
                break
            batch.append(job)
            if job.kind == "verify":
                rows += len(job.request.items)

    def _evict_idle(self) -> None:
        now = self.clock()
        for sid in [s for s, sess in self.sessions.items() if now - sess.last_used > self.session_timeout_s]:
            log.info("evicting session %s after %.0f s idle", sid, self.session_timeout_s)
            self._free_session(sid)

    def _free_session(self, sid: str) -> None:
        sess = self.sessions.pop(sid)
        self.state.done[sess.slot] = True
        self._free.append(sess.slot)

    def _open(self, r: verify_pb2.OpenRequest, node: str = SHARED_NODE) -> verify_pb2.OpenReply:
        started = time.perf_counter()
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if r.session_id in self.sessions:
            raise _CallError(bad, f"session {r.session_id} is already open")
        if not 0.0 <= r.u_first < 1.0:
            raise _CallError(bad, f"u_first={r.u_first} must be a finite number in [0, 1)")
        if not r.prompt_ids or r.max_new_tokens < 1 or not 0 <= r.k_max <= self.k_max:
            raise _CallError(
                bad, f"need a prompt, max_new_tokens >= 1 and 0 <= k_max <= {self.k_max} (got {len(r.prompt_ids)} "
                f"prompt tokens, max_new_tokens={r.max_new_tokens}, k_max={r.k_max})",
            )  # fmt: skip
        if any(not 0 <= t < self.vocab_size for t in r.prompt_ids):
            raise _CallError(bad, f"prompt token ids must be in 0..{self.vocab_size - 1}")
        need = len(r.prompt_ids) + r.max_new_tokens + r.k_max + 1
        if need > self.max_len:
            raise _CallError(bad, f"session needs {need} positions; the target's max_len is {self.max_len}")
        try:
            params = SamplingParams(r.sampling.temperature, r.sampling.top_k, r.sampling.top_p or 1.0)
        except ValueError as e:
            raise _CallError(bad, str(e)) from None
        held = sum(1 for sess in self.sessions.values() if sess.node == node)
        if held >= self.max_sessions_per_node:
            raise _CallError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"draft node {node!r} holds {held} sessions, its cap "
                             f"(grpc.max_sessions_per_node={self.max_sessions_per_node}); close one first")  # fmt: skip
        if not self._free:
            raise _CallError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"all {self.B} target slots are in use")
        b = self._free.pop()
        prompt = torch.tensor([list(r.prompt_ids)], dtype=torch.long, device=self.device)  # [1, L]
        first = prefill_first_token(self.runner, prompt, b, params, torch.tensor([r.u_first]))
        done = start_row(self.state, b, prompt[0], first, r.max_new_tokens)
        self.sessions[r.session_id] = _Session(b, params, r.k_max, self.clock(), node)
        return verify_pb2.OpenReply(
            first_token=first, done=done, instance_id=self.instance_id,
            target_ms=1e3 * (time.perf_counter() - started),
        )  # fmt: skip

    def _close(self, r: verify_pb2.CloseRequest) -> verify_pb2.CloseReply:
        known = [sid for sid in r.session_ids if sid in self.sessions]
        for sid in known:
            self._free_session(sid)
        return verify_pb2.CloseReply(closed=len(known))

    def _verify(self, jobs: list[_Job]) -> None:
        # A call whose K is out of range is refused alone, before it can join (and fail) a batch.
        for j in jobs:
            if not 0 <= j.request.k <= self.k_max:
                log.warning("refused a Verify call: k=%d outside 0..%d", j.request.k, self.k_max)
                j.future.set_exception(_CallError(grpc.StatusCode.INVALID_ARGUMENT,
                                                  f"k={j.request.k} must be in 0..{self.k_max} (the target's largest K)"))  # fmt: skip
        jobs = [j for j in jobs if not j.future.done()]
        results: list[list[verify_pb2.VerifyResult | None]] = [[None] * len(j.request.items) for j in jobs]
        groups: dict[int, list[tuple[int, int]]] = {}
        for ji, j in enumerate(jobs):
            for ii in range(len(j.request.items)):
                groups.setdefault(j.request.k, []).append((ji, ii))
        rows = 0
        for k, entries in sorted(groups.items()):
            while entries:  # a session twice in one group (never from a well-behaved node) goes later
                seen, now, later = set(), [], []
                for e in entries:
                    sid = jobs[e[0]].request.items[e[1]].session_id
                    (later if sid in seen else now).append(e)
                    seen.add(sid)
                rows = max(rows, self._verify_group(k, [(jobs[ji].request.items[ii], results[ji], ii) for ji, ii in now]))
                self.max_calls_per_forward = max(self.max_calls_per_forward, len({ji for ji, _ in now}))
                entries = later
        done = time.perf_counter()
        for j, res in zip(jobs, results):
            j.future.set_result(
                verify_pb2.VerifyReply(
                    results=res, instance_id=self.instance_id, target_ms=1e3 * (done - j.received), batch_rows=rows
                )
            )

    def _check(self, item: verify_pb2.VerifyItem, k: int) -> str:
        sess = self.sessions.get(item.session_id)
        if sess is None:
            return (
                f"unknown session {item.session_id}: evicted after {self.session_timeout_s:g} s idle, closed, or "
                f"opened on an earlier run of the target (now instance {self.instance_id[:8]})"
            )
        b = sess.slot
        m = len(item.draft_tokens)  # this session's real draft tokens: up to K, the rest is padding
        if m > min(k, sess.k_max) or len(item.u_accept) != m:
            return f"K={k} with {m} draft tokens and {len(item.u_accept)} uniforms (k_max {sess.k_max})"
        if item.q and len(item.q) != 4 * m * self.vocab_size:
            return f"q has {len(item.q)} bytes, expected float32 [{m}, {self.vocab_size}]"
        if not item.q and m > 0 and not sess.params.greedy:
            return "a sampled session needs q"
        if not all(0.0 <= u < 1.0 for u in (*item.u_accept, item.u_next)):  # NaN fails every comparison
            return "uniforms must be finite numbers in [0, 1)"
        if item.q:
            q = torch.frombuffer(bytearray(item.q), dtype=torch.float32)
            if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
                return "q must hold finite, non-negative probabilities"
        bad = [t for t in item.draft_tokens if not 0 <= t < self.vocab_size]
        if bad:
            return f"draft token ids {bad[:3]} are outside the vocabulary 0..{self.vocab_size - 1}"
        n, pending = item.length, list(item.pending)
        if not pending or n != int(self.state.lengths[b]) or self.state.tokens[b, n - len(pending) : n].tolist() != pending:
            return f"session out of sync: the draft node is at {n} tokens, the target at {int(self.state.lengths[b])}"
        if bool(self.state.done[b]):
            return "session already finished"
        return ""

    def _verify_group(self, k: int, entries: list[tuple[verify_pb2.VerifyItem, list, int]]) -> int:
        """One target forward for sessions that all verify K tokens; writes their results."""
        B, V, dev = self.B, self.vocab_size, self.device
        draft_tokens = torch.zeros(B, k, dtype=torch.long)  # [B, K]
        q = torch.zeros(B, k, V)  # [B, K, V]
        u_accept, u_next = torch.zeros(B, k), torch.zeros(B)  # [B, K], [B]
        n_draft = torch.zeros(B, dtype=torch.long)  # [B] real draft tokens per row
        live = torch.zeros(B, dtype=torch.bool)
        params = [SamplingParams()] * B
        answer = []
        now = self.clock()
        for item, out, i in entries:
            error = self._check(item, k)
            if error:
                out[i] = verify_pb2.VerifyResult(session_id=item.session_id, error=error)
                continue
            sess = self.sessions[item.session_id]
            sess.last_used = now
            b, m = sess.slot, len(item.draft_tokens)
            n_draft[b] = m
            draft_tokens[b, :m] = torch.tensor(list(item.draft_tokens), dtype=torch.long)
            if item.q:
                q[b, :m] = torch.frombuffer(bytearray(item.q), dtype=torch.float32).view(m, V)
            elif m > 0:  # greedy: q is one-hot at the draft token, as probs_from_logits makes it
                q[b, :m] = torch.nn.functional.one_hot(draft_tokens[b, :m], V).float()
            u_accept[b, :m] = torch.tensor(list(item.u_accept))
            u_next[b] = item.u_next
            live[b] = True
            params[b] = sess.params
            answer.append((item.session_id, out, i, b))
        if not answer:
            return 0
        s = self.state
        live = live.to(dev)
        frozen = s.done.clone()
        s.done |= ~live  # rows outside this group must not move
        rand = StepRandom(draft=u_accept[:, :0].to(dev), accept=u_accept.to(dev), next=u_next.to(dev))
        sampling = SamplingTensors.build(params, dev)
        try:
            n_acc, next_token, _ = verify_half(self.runner, s, sampling, rand, draft_tokens.to(dev), q.to(dev),
                                               n_draft=n_draft.to(dev))  # fmt: skip
        finally:  # also when the forward fails: the other sessions' rows must not stay frozen
            s.done.copy_(torch.where(live, s.done, frozen))
        self.forwards += 1
        rows = torch.stack([n_acc, next_token, s.done.long()], 1).tolist()  # the one host sync
        for sid, out, i, b in answer:
            out[i] = verify_pb2.VerifyResult(
                session_id=sid, n_accepted=rows[b][0], next_token=rows[b][1], done=bool(rows[b][2])
            )
        return len(answer)


class VerifyServer:
    """A ``VerifyService`` on a gRPC server: ``start()`` returns the bound port (``port=0``
    picks a free one), ``stop()`` fails calls in flight with UNAVAILABLE and frees the port."""

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "target",
        max_batch_size: int = 8,
        max_len: int | None = None,
        k_buckets: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8),
        session_timeout_s: float = SESSION_TIMEOUT_S,
        batch_window_ms: float = 2.0,
        workers: int = 32,
        token: str | None = None,
        node_tokens: dict[str, str] | None = None,
        max_sessions_per_node: int | None = None,
        tls: tuple[bytes, bytes] | None = None,
    ) -> None:
        """``token``: the shared secret every call must carry (None: none asked, for loopback);
        ``node_tokens``: instead, draft node name -> its own token (each node then has an identity,
        and at most ``max_sessions_per_node`` sessions); ``tls``: (PEM certificate chain, PEM
        private key) to serve TLS instead of plaintext."""
        if token is not None and node_tokens:
            raise ValueError("give the target one shared token or per-node tokens, not both")
        self.host, self.port, self.workers, self.tls = host, port, workers, tls
        self.tokens: str | dict[str, str] | None = dict(node_tokens) if node_tokens else token
        self.service = VerifyService(
            target, tokenizer, name=name, max_batch_size=max_batch_size, max_len=max_len,
            k_max=max(k_buckets), session_timeout_s=session_timeout_s, batch_window_ms=batch_window_ms,
            nodes=dict(node_tokens) if node_tokens else None, max_sessions_per_node=max_sessions_per_node,
        )  # fmt: skip
        self._server: grpc.Server | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> int:
        # Handler threads only wait on the worker, so many of them cost little; they bound how many
        # calls (draft nodes x in-flight RPCs) can be queued at once.
        s = self.service
        limit = max_verify_bytes(s.B, s.k_max, s.vocab_size, s.max_len)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.workers),
                             interceptors=[TokenCheck(self.tokens)] if self.tokens else [],
                             options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", 1 << 30)])  # fmt: skip
        verify_pb2_grpc.add_VerifierServicer_to_server(self.service, server)
        if self.tls is not None:
            creds = grpc.ssl_server_credentials([(self.tls[1], self.tls[0])])  # [(private key, certificate chain)]
            bound = server.add_secure_port(f"{self.host}:{self.port}", creds)
        else:
            bound = server.add_insecure_port(f"{self.host}:{self.port}")
        if bound == 0:
            raise OSError(f"cannot listen on {self.host}:{self.port}: the port is taken or the host is not local")
        self.port = bound
        self.service.start()
        server.start()
        self._server = server
        return bound

    def stop(self, grace: float | None = None) -> None:
        self.service.stop()
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None

    def wait(self) -> None:
        self._server.wait_for_termination()

    def __enter__(self) -> "VerifyServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def unsupported_on_target(settings: EngineSettings) -> str | None:
    """Why ``settings`` cannot run the target role (its forward runs eagerly), or None: checked by
    ``serve_target`` and by ``serve``'s config check before anything loads."""
    if settings.compile_backend is not None or settings.cuda_graphs:
        return ("role=target runs its forward eagerly: engine.compile_backend and engine.cuda_graphs are not supported "
                "there yet; drop them for --role target")
    return None


def serve_target(
    target_ref: str,
    settings: EngineSettings,
    *,
    host: str = "0.0.0.0",
    port: int = 50051,
    session_timeout_s: float = SESSION_TIMEOUT_S,
    batch_window_ms: float = 2.0,
    token: str | None = None,
    node_tokens: dict[str, str] | None = None,
    max_sessions_per_node: int | None = None,
    tls: tuple[bytes, bytes] | None = None,
) -> None:
    """Load the target and serve verification until interrupted (``serve --role target``).
    ``settings``: the engine settings, resolved for this target; the target loads and is prepared
    by the same code as in fused mode (``load_models``, ``prepare_kernels``), so every setting that
    applies to a target (precision, threads, weights cache, quantization) applies here too."""
    from serving.engine.loader import load_models, prepare_kernels

    if (why := unsupported_on_target(settings)) is not None:
        raise ValueError(why)
    tokenizer, model, _ = load_models(settings, target_ref)
    # a draft node may verify any K up to the largest (draft-confidence stops)
    prepare_kernels(settings, [model], [], tuple(range(2, max(settings.k_buckets) + 2)))
    server = VerifyServer(
        model, tokenizer, host=host, port=port, name=target_ref, max_batch_size=settings.max_batch_size,
        max_len=settings.max_len, k_buckets=settings.k_buckets, session_timeout_s=session_timeout_s,
        batch_window_ms=batch_window_ms, token=token, node_tokens=node_tokens, max_sessions_per_node=max_sessions_per_node,
        tls=tls,
    )  # fmt: skip
    server.start()
    print(f"target {target_ref} verifying on {host}:{server.port} ({settings.max_batch_size} slots, K <= {max(settings.k_buckets)}; "
          f"{'TLS' if tls else 'plaintext'}, {'per-node tokens' if node_tokens else 'token required' if token else 'no token'})", flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(grace=1.0)
