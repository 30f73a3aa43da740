"""The draft side of distributed serving: a ``Verifier`` whose target is a gRPC service.

    engine = SpeculativeEngine(RemoteVerifier("10.0.0.5:50051"), tokenizer, draft, EngineConfig(max_batch_size=8, k=4))
    [out] = engine.generate([Request(tokenizer.encode("def add(a, b):"), max_new_tokens=32)])

The engine is the fused one (``serving.engine.SpeculativeEngine``): only its target is elsewhere.
Each request is a session on the target (serving/distributed/verify.proto): admission opens it
(the target prefills and draws the first token), every step drafts locally and sends one Verify
call for all running rows; the answer (accepted count + correction or bonus token per row) is
applied to the local state with the same ``commit`` the target ran. Uniforms come from each
request's seeded generator on this node, so output equals the fused engine's.

If the target cannot be reached, or lost sessions (restart, idle eviction), the engine's ``step``
raises ``TargetUnavailable`` naming the failed request ids; they are gone from the engine, the
other requests keep going, and later calls reconnect by themselves.
"""

from __future__ import annotations

import logging
import socket
import ssl
import tempfile
import time
import uuid
from collections import deque

import grpc
import torch

from serving.distributed import verify_pb2, verify_pb2_grpc
from serving.distributed.verify_service import MESSAGE_OPTIONS
from serving.engine.engine_settings import EngineConfig
from serving.engine.sampling import SamplingParams
from serving.engine.verifier import Verdict, Verifier, VerifierError, VerifyBatch

log = logging.getLogger(__name__)

# The call never reached a working target (or its answer never came back): reconnect next time.
_CONNECTION_LOST = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}


class TargetUnavailable(VerifierError):
    """The target service could not serve some requests; the engine's ``step`` raises it with
    ``request_ids`` naming them (they are finished: failed)."""

    def __init__(self, message: str, address: str, rows: list[int] | None = None) -> None:
        super().__init__(message, rows)
        self.address = address


def tls_mismatch(address: str, tls_ca: bytes | None, timeout_s: float = 3.0) -> str | None:
    """Why a target that cannot be reached over gRPC may be up after all: a TLS handshake with it
    tells a plaintext client from a TLS server, a TLS client from a plaintext server, and a
    certificate that ``tls_ca`` does not vouch for. None when the port does not answer at all (or
    the handshake says nothing either way): then the address or the target is the problem."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"

    def handshake(context: ssl.SSLContext) -> bool:
        """True when the TLS handshake completes; False when the port accepts a connection but not
        TLS; OSError when nothing accepts one."""
        context.set_alpn_protocols(["h2"])  # gRPC's
        with socket.create_connection((host, int(port)), timeout=timeout_s) as raw:
            try:
                with context.wrap_socket(raw, server_hostname=host if tls_ca is not None else None):
                    return True
            except ssl.SSLCertVerificationError:
                raise
            except OSError:  # ssl.SSLError included: the peer answered in something other than TLS, or hung up
                return False

    unverified = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE
    try:
        serves_tls = handshake(unverified)
    except (OSError, ValueError):  # nothing listens there, or a malformed address
        return None
    if not serves_tls:
        if tls_ca is not None:
            return (f"The target at {address} does not serve TLS (plaintext): drop grpc.tls_ca on this draft node, or "
                    "start the target with grpc.tls_cert and grpc.tls_key.")  # fmt: skip
        return None
    if tls_ca is None:
        return (f"The target at {address} serves TLS and this draft node connected in plaintext: give it grpc.tls_ca "
                "(the target's certificate, or the CA that signed it).")  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".pem") as ca:
        ca.write(tls_ca)
        ca.flush()
        verified = ssl.create_default_context(cafile=ca.name)
        verified.check_hostname = False  # gRPC checks the name itself; here only the chain is in question
        try:
            handshake(verified)  # a plain False cannot happen here: the unverified handshake completed
        except ssl.SSLCertVerificationError as e:
            return (f"The target at {address} serves TLS with a certificate that grpc.tls_ca does not vouch for "
                    f"({e.verify_message}): give this draft node the target's certificate or the CA that signed it.")
        except (OSError, ValueError):
            return None
    return None


class RemoteVerifier(Verifier):
    def __init__(
        self, target_address: str, timeout_s: float = 30.0, *, token: str | None = None, tls_ca: bytes | None = None
    ) -> None:
        """The target at ``target_address`` (HOST:PORT of ``serve --role target``). It connects when
        the engine binds it, waiting up to ``timeout_s`` for the target to come up; ``timeout_s``
        is also the deadline of every later call. ``token``: the target's shared secret, sent with
        every call; ``tls_ca``: PEM certificate(s) to trust, to connect over TLS."""
        self.address = target_address
        self.name = f"the target at {target_address}"
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._tls_ca = tls_ca
        self.available = True  # whether the last call reached the target (a draft node's /health)
        self._unclosed: list[str] = []  # sessions released while the channel was down: closed on reconnect
        self._channel: grpc.Channel | None = None
        self._stub: verify_pb2_grpc.VerifierStub | None = None
        self._closing: list[grpc.Future] = []
        self._sessions: list[str | None] = []  # per row of the engine's batch: its session on the target
        self._ended: set[int] = set()  # rows the target said ended: verifying one again is a broken peer
        self.target_info: verify_pb2.InfoReply | None = None
        self.instance_id = ""  # the target process that answered last
        # (round trip, time the target spent on it) in seconds, of recent Verify calls.
        self.verify_times: deque[tuple[float, float]] = deque(maxlen=4096)

    # ---- Verifier --------------------------------------------------------------------------------

    def bind(self, config: EngineConfig) -> None:
        try:
            info = self._call("Info", verify_pb2.InfoRequest(), wait_for_ready=True)
        except TargetUnavailable as e:
            tls = tls_mismatch(self.address, self._tls_ca)
            hint = tls or "Start it first (`serve --role target`) or fix the address (--target HOST:PORT)."
            raise TargetUnavailable(f"{e} {hint}", self.address) from e.__cause__
        self.target_info, self.instance_id = info, info.instance_id
        if config.max_len is None:
            config.max_len = info.max_len
        if config.max_len > info.max_len:  # the target's context per session is the limit
            raise ValueError(f"max_len={config.max_len} exceeds the target's max_len={info.max_len} at {self.address}")
        self.vocab_size, self.eos_ids, self.max_len, self.k_max = info.vocab_size, list(info.eos_ids), info.max_len, info.k_max
        self._sessions = [None] * config.max_batch_size

    def prefill(
        self, row: int, prompt: torch.Tensor, params: SamplingParams, u: torch.Tensor, *, max_new_tokens: int, k_max: int
    ) -> int | None:
        if params.lossy:  # the Open call carries no threshold: the service would verify exactly
            raise ValueError(f"verification={params.verification!r} is not carried to a target service ({self.address}); "
                             "send verification='exact' or serve the target in this process")  # fmt: skip
        carried = [*params.processors, *(("logprobs",) if params.logprobs is not None else ())]
        if carried:  # the Open call carries temperature, top-k and top-p only: the service would ignore them
            raise ValueError(f"{', '.join(carried)} are not carried to a target service ({self.address}); serve the "
                             "target in this process (role fused) for logits processors and logprobs")  # fmt: skip
        session_id = uuid.uuid4().hex
        call = verify_pb2.OpenRequest(
            session_id=session_id, prompt_ids=prompt[0].tolist(), max_new_tokens=max_new_tokens,
            sampling=verify_pb2.Sampling(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p),
            k_max=k_max, u_first=float(u[0]),
        )  # fmt: skip
        try:
            reply = self._call("Open", call, failing=1)
        except TargetUnavailable as e:
            if e.__cause__ is not None and e.__cause__.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return None  # every target slot is taken (other draft nodes): wait for one
            raise
        self._sessions[row] = session_id
        self.instance_id = reply.instance_id
        return reply.first_token

    def verify(self, batch: VerifyBatch) -> Verdict:
        s = batch.state
        B, k = batch.draft_tokens.shape
        live = [b for b, p in enumerate(batch.params) if p is not None]
        n = s.lengths.cpu()  # [B]
        last = s.tokens.gather(1, (s.lengths - 1).unsqueeze(1)).squeeze(1).tolist()  # [B] x_{n-1}
        drafts, u_accept, u_next = batch.draft_tokens.tolist(), batch.rand.accept[:, :k].tolist(), batch.rand.next.tolist()
        counts = batch.n_draft.tolist()  # [B]
        q = batch.q.to("cpu", torch.float32).contiguous()  # [B, K, V]
        # Each item carries only its row's real draft tokens; the target pads the rest of K.
        items = [
            verify_pb2.VerifyItem(
                session_id=self._sessions[b], length=int(n[b]), pending=[last[b]], draft_tokens=drafts[b][: counts[b]],
                # Greedy q is one-hot at the draft token: the target rebuilds it, nothing to send.
                q=b"" if counts[b] == 0 or batch.params[b].greedy else q[b, : counts[b]].numpy().tobytes(),
                u_accept=u_accept[b][: counts[b]], u_next=u_next[b],
            )  # fmt: skip
            for b in live
        ]
        sent = time.perf_counter()
        reply = self._call("Verify", verify_pb2.VerifyRequest(k=k, items=items))
        self.verify_times.append((time.perf_counter() - sent, reply.target_ms / 1e3))
        n_acc = torch.zeros(B, dtype=torch.long)
        next_token = torch.zeros(B, dtype=torch.long)
        lost: dict[int, str] = {}
        for b, r in zip(live, reply.results):
            if r.error:
                lost[b] = r.error
            elif b in self._ended:  # both run the same commit: the row had ended there
                lost[b] = "target and draft node disagree on whether the request ended (target: True)"
            else:
                n_acc[b], next_token[b] = r.n_accepted, r.next_token
                if r.done:
                    self._ended.add(b)
        failed = None
        if lost:
            for b in lost:  # gone on the target (or never to be trusted again)
                self._sessions[b] = None
            reasons = sorted(set(lost.values()))
            failed = TargetUnavailable(
                f"target {self.address} no longer holds the session of {len(lost)} request(s), which failed: "
                f"{'; '.join(reasons)}. New requests open fresh sessions.",
                self.address,
                sorted(lost),
            )
        device = batch.draft_tokens.device
        return Verdict(n_acc.to(device), next_token.to(device), failed)

    def release(self, row: int) -> None:
        self._ended.discard(row)
        session_id, self._sessions[row] = self._sessions[row], None
        if session_id is None:
            return
        if self._stub is None:  # the connection dropped with the step: close it once we are back
            self._unclosed.append(session_id)
            return
        self._close([session_id])

    def _close(self, session_ids: list[str]) -> None:
        self._closing = [f for f in self._closing if not f.done()]
        # Fire and forget (kept referenced so it is not cancelled); an idle session is evicted anyway.
        self._closing.append(self._stub.Close.future(verify_pb2.CloseRequest(session_ids=session_ids), timeout=self.timeout_s,
                                                     metadata=self._metadata))  # fmt: skip

    def probe(self, timeout_s: float = 2.0) -> bool:
        """Whether the target answers ``Info`` now, on a channel of its own (``/health`` calls it
        from another thread while the engine may be mid-call)."""
        channel = self._new_channel()
        try:
            verify_pb2_grpc.VerifierStub(channel).Info(verify_pb2.InfoRequest(), timeout=timeout_s, metadata=self._metadata)
            return True
        except grpc.RpcError:
            return False
        finally:
            channel.close()

    def _new_channel(self) -> grpc.Channel:
        if self._tls_ca is not None:
            return grpc.secure_channel(self.address, grpc.ssl_channel_credentials(root_certificates=self._tls_ca),
                                       options=MESSAGE_OPTIONS)  # fmt: skip
        return grpc.insecure_channel(self.address, options=MESSAGE_OPTIONS)

    def close(self) -> None:
        self._reset_channel()

    # ---- connection ----------------------------------------------------------------------------

    def _call(self, method: str, request, wait_for_ready: bool = False, failing: int = 0):
        """``failing``: requests besides the open sessions that fail with this call (an Open's)."""
        if self._stub is None:
            self._channel = self._new_channel()
            self._stub = verify_pb2_grpc.VerifierStub(self._channel)
        started = time.perf_counter()
        try:
            reply = getattr(self._stub, method)(request, timeout=self.timeout_s, wait_for_ready=wait_for_ready,
                                                metadata=self._metadata)  # fmt: skip
        except grpc.RpcError as e:
            code = e.code()
            if code in _CONNECTION_LOST:
                if self.available:
                    log.error("target %s went away (%s on %s after %.1f s): its requests fail until it is back",
                              self.address, code.name, method, time.perf_counter() - started)
                self.available = False
                # A fresh channel next time: gRPC's own reconnect backoff can stretch to minutes.
                self._reset_channel()
                what = f"cannot be reached ({code.name} after {time.perf_counter() - started:.1f} s: {e.details()})"
            else:
                what = f"refused {method} ({code.name}: {e.details()})"
            message = f"target {self.address} {what}."
            if method != "Info" and code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                # Every open session fails with the call: the engine drops them all.
                failed = failing + sum(s is not None for s in self._sessions)
                message += (f" {failed} request(s) failed; start the target with `serve --role target` or check "
                            f"--target {self.address}. This node reconnects by itself: new requests succeed once it is back.")  # fmt: skip
            raise TargetUnavailable(message, self.address) from e
        if not self.available:
            log.warning("target %s is back", self.address)
            self.available = True
        if self._unclosed:
            self._close(self._unclosed)
            self._unclosed = []
        return reply

    def _reset_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None
        self._closing = []
