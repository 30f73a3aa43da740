"""Distributed serving over loopback gRPC: a draft node (SpeculativeEngine with a RemoteVerifier)
against the target service (VerifyServer) gives exactly the fused engine's output, greedy and seeded sampled,
also with two draft nodes sharing one target; sessions are evicted when idle; a target that goes
away fails its requests with TargetUnavailable and a restarted one serves new requests."""

import threading
import time

import pytest
import torch

from serving.distributed.remote import RemoteVerifier, TargetUnavailable
from serving.distributed.verify_service import VerifyServer
from serving.engine import EngineConfig, Request, SpeculativeEngine
from serving.engine.sampling import SamplingParams

pytestmark = pytest.mark.e2e

MAX_LEN = 96


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (n,), generator=g).tolist()
    return [torch.randint(3, 384, (length,), generator=g).tolist() for length in lengths]


def remote_engine(draft, tokenizer, address, config, timeout_s=30.0):
    """A draft node: the fused engine with its target behind gRPC."""
    return SpeculativeEngine(RemoteVerifier(address, timeout_s=timeout_s), tokenizer, draft, config)


def fused(target, draft, tokenizer, requests, batch=2, k=3):
    engine = SpeculativeEngine(target, tokenizer, draft, EngineConfig(max_batch_size=batch, max_len=MAX_LEN, k=k))
    return engine.generate(requests)


@pytest.fixture(scope="module")
def server(tiny_target, tokenizer):
    with VerifyServer(tiny_target, tokenizer, max_batch_size=8, max_len=MAX_LEN) as s:
        yield s


@pytest.mark.parametrize("batch,k", [(1, 3), (3, 3), (3, "auto"), (2, 0)])
def test_greedy_identical_to_fused(server, tiny_target, tiny_draft, tokenizer, batch, k):
    requests = [Request(p, max_new_tokens=20) for p in prompts(5, seed=batch + 7)]
    config = EngineConfig(max_batch_size=batch, max_len=MAX_LEN, k=k)
    remote = remote_engine(tiny_draft, tokenizer, server.address, config)
    outs = remote.generate(requests)
    assert [o.token_ids for o in outs] == [o.token_ids for o in fused(tiny_target, tiny_draft, tokenizer, requests, k=k)]
    stats = outs[0].stats
    assert stats["target_time_s"] > 0 and stats["target_calls"] >= 1
    if k != 0:
        assert stats["drafted"] > 0 and stats["target_calls"] < stats["new_tokens"]
    assert not remote.has_unfinished_requests()


def test_seeded_sampling_identical_to_fused(server, tiny_target, tiny_draft, tokenizer):
    # Greedy and sampled rows share the batch; each sampled row has its own seed.
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(4)] + [SamplingParams()]
    requests = [Request(p, params=s, max_new_tokens=16) for p, s in zip(prompts(5, seed=3), params)]
    remote = remote_engine(tiny_draft, tokenizer, server.address, EngineConfig(max_batch_size=3, max_len=MAX_LEN, k=3))
    outs = remote.generate(requests)
    expected = fused(tiny_target, tiny_draft, tokenizer, requests, batch=3)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert len({tuple(o.token_ids) for o in outs}) == 5


def test_incremental_api_stop_strings_and_abort(server, tiny_target, tiny_draft, tokenizer):
    remote = remote_engine(tiny_draft, tokenizer, server.address, EngineConfig(max_batch_size=2, max_len=MAX_LEN, k=2))
    [free] = fused(tiny_target, tiny_draft, tokenizer, [Request([5, 6, 7], max_new_tokens=12)])
    stop = free.text[1:3]
    assert stop.strip()
    dropped = remote.add_request(Request([9, 10], max_new_tokens=40))
    keep = remote.add_request(Request([5, 6, 7], max_new_tokens=12, stop=(stop,)))
    with pytest.raises(ValueError, match="max_len"):
        remote.add_request(Request([1] * 90, max_new_tokens=10))
    streamed, finished = [], None
    for out in remote.step():
        if out.request_id == keep:
            streamed += out.new_token_ids
            finished = out.finished
    running = remote.num_running
    assert remote.abort_request(dropped) and remote.num_running == running - 1
    assert not remote.abort_request(dropped)
    while remote.has_unfinished_requests():
        for out in remote.step():
            assert out.request_id == keep
            streamed += out.new_token_ids
            finished = out.finished or finished
    assert finished.finish_reason == "stop" and finished.text == free.text[: free.text.find(stop)]
    assert streamed == finished.token_ids and len(finished.token_ids) < len(free.token_ids)
    deadline = time.monotonic() + 5  # closes are fire-and-forget
    while server.service.sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.service.sessions


def test_two_draft_nodes_share_one_target(tiny_target, tiny_draft, tokenizer):
    # Fewer target slots (3) than the two nodes want (2 x 2): admission waits for a free slot.
    # Both nodes' first Verify calls leave together (a barrier), and the target's batch window is
    # long until its first forward: that forward holds calls of both nodes whatever the machine's
    # speed (the window still closes at once when every open session has a call waiting).
    with VerifyServer(tiny_target, tokenizer, max_batch_size=3, max_len=MAX_LEN, k_buckets=(3,)) as server:
        service = server.service
        service.batch_window_s = 60.0
        collect = service._collect

        def collect_then_shorten(batch):
            collect(batch)
            service.batch_window_s = 0.002

        service._collect = collect_then_shorten
        together = threading.Barrier(2, timeout=60)
        jobs = {name: [Request(p, max_new_tokens=16) for p in prompts(4, seed=seed)] for name, seed in (("a", 11), ("b", 12))}
        results, errors = {}, []

        def node(name):
            try:
                remote = remote_engine(tiny_draft, tokenizer, server.address, EngineConfig(max_batch_size=2, max_len=MAX_LEN, k=3))
                call, first = remote.verifier._call, [True]

                def first_verify_together(method, *a, **k):
                    if method == "Verify" and first[0]:
                        first[0] = False
                        together.wait()
                    return call(method, *a, **k)

                remote.verifier._call = first_verify_together
                results[name] = remote.generate(jobs[name])
            except Exception as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=node, args=(name,)) for name in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        for name, requests in jobs.items():
            expected = fused(tiny_target, tiny_draft, tokenizer, requests)
            assert [o.token_ids for o in results[name]] == [o.token_ids for o in expected]
        assert service.max_calls_per_forward >= 2  # calls of both nodes in one forward


class FakeClock:
    """A clock the test moves: whether a session is idle does not depend on how fast the machine is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    """Poll for an event that must happen; the timeout only guards against a hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        time.sleep(0.01)


def test_idle_session_is_evicted(tiny_target, tiny_draft, tokenizer):
    clock = FakeClock()
    with VerifyServer(tiny_target, tokenizer, max_batch_size=2, max_len=MAX_LEN, k_buckets=(2,), session_timeout_s=0.3) as server:
        server.service.clock = clock
        remote = remote_engine(tiny_draft, tokenizer, server.address, EngineConfig(max_batch_size=2, max_len=MAX_LEN, k=2))
        rid = remote.add_request(Request([5, 6, 7], max_new_tokens=40))
        remote.step()
        assert len(server.service.sessions) == 1
        clock.now += 0.2  # idle, but not for long enough
        time.sleep(0.2)  # the worker looks for idle sessions every 50 ms while it has no job
        assert len(server.service.sessions) == 1
        clock.now += 0.2  # 0.4 s idle on the session's clock
        wait_until(lambda: not server.service.sessions, "the idle session's eviction")  # the slot is free for others
        with pytest.raises(TargetUnavailable, match="evicted after 0.3 s idle") as e:
            remote.step()
        assert e.value.request_ids == [rid] and not remote.has_unfinished_requests()
        requests = [Request([5, 6, 7], max_new_tokens=12)]
        assert remote.generate(requests)[0].token_ids == fused(tiny_target, tiny_draft, tokenizer, requests, k=2)[0].token_ids


def test_target_down_then_back(tiny_target, tiny_draft, tokenizer):
    requests = [Request(p, max_new_tokens=24) for p in prompts(3, seed=5)]
    expected = [o.token_ids for o in fused(tiny_target, tiny_draft, tokenizer, requests)]
    server = VerifyServer(tiny_target, tokenizer, max_batch_size=4, max_len=MAX_LEN, k_buckets=(3,))
    port = server.start()
    remote = remote_engine(tiny_draft, tokenizer, server.address, EngineConfig(max_batch_size=2, max_len=MAX_LEN, k=3))
    ids = [remote.add_request(r) for r in requests]
    remote.step()
    server.stop()  # mid-stream
    with pytest.raises(TargetUnavailable) as e:
        remote.step()
    message = str(e.value)
    assert f"127.0.0.1:{port}" in message and "serve --role target" in message and "reconnects" in message
    assert sorted(e.value.request_ids) == ids[:2]  # the two running ones; the third still waits
    assert remote.num_running == 0 and remote.num_waiting == 1
    with pytest.raises(TargetUnavailable, match="cannot be reached") as e:
        remote.step()  # the waiting one fails at admission while the target is down
    assert e.value.request_ids == [ids[2]] and not remote.has_unfinished_requests()

    restarted = VerifyServer(tiny_target, tokenizer, port=port, max_batch_size=4, max_len=MAX_LEN, k_buckets=(3,))
    restarted.start()
    try:
        assert [o.token_ids for o in remote.generate(requests)] == expected
    finally:
        restarted.stop()


def test_unreachable_target_at_start_names_the_address(tiny_draft, tokenizer):
    with VerifyServer(tiny_draft, tokenizer) as probe:  # a port that was free a moment ago
        address = probe.address
    with pytest.raises(TargetUnavailable, match=f"{address}.*serve --role target"):
        remote_engine(tiny_draft, tokenizer, address, EngineConfig(max_len=MAX_LEN), timeout_s=0.5)


def test_a_session_at_its_context_end_does_not_fail_larger_k_verifies(server, tiny_target, tiny_draft, tokenizer):
    """A target-only session (k_max=0) reserves no room past its limit. Once it is within K of
    the context end, a Verify of K=8 from another session freezes its row in a forward that
    would write past its cache: that row must stay inside it, and both sessions decode as fused."""
    long_request = Request(list(range(3, 43)), max_new_tokens=MAX_LEN - 40 - 1)  # needs exactly MAX_LEN positions
    alone = remote_engine(None, tokenizer, server.address, EngineConfig(max_len=MAX_LEN, k=0))
    alone.add_request(long_request)
    tokens, finished = [], None
    while len(tokens) < long_request.max_new_tokens - 3 and alone.has_unfinished_requests():
        for out in alone.step():
            tokens += out.new_token_ids
    assert len(tokens) == long_request.max_new_tokens - 3, "the session must be running three tokens short of its limit"
    others = [Request(p, max_new_tokens=12) for p in prompts(3, seed=11)]
    spec = remote_engine(tiny_draft, tokenizer, server.address, EngineConfig(max_batch_size=3, max_len=MAX_LEN, k=8))
    outs = spec.generate(others)
    assert [o.token_ids for o in outs] == [o.token_ids for o in fused(tiny_target, tiny_draft, tokenizer, others, k=8)]
    while alone.has_unfinished_requests():
        for out in alone.step():
            tokens += out.new_token_ids
            finished = out.finished or finished
    [expected] = fused(tiny_target, None, tokenizer, [long_request], batch=1, k=0)
    assert tokens == expected.token_ids and finished.token_ids == expected.token_ids


def test_a_poisoned_client_fails_alone(server, tiny_target, tiny_draft, tokenizer):
    """A client looping Verify(k=-1), NaN uniforms and negative q while a draft node decodes: its
    calls are refused (INVALID_ARGUMENT, or an error on its own item) and the draft node's output
    is the fused engine's (these calls once failed every session batched with them)."""
    import grpc

    from serving.distributed import verify_pb2, verify_pb2_grpc

    stub = verify_pb2_grpc.VerifierStub(grpc.insecure_channel(server.address))
    with pytest.raises(grpc.RpcError) as info:
        stub.Open(verify_pb2.OpenRequest(session_id="bad-open", prompt_ids=[5, 6], max_new_tokens=4, k_max=2,
                                         u_first=float("nan")), timeout=10)  # fmt: skip
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stub.Open(verify_pb2.OpenRequest(session_id="poison", prompt_ids=[5, 6, 7], max_new_tokens=40, k_max=2, u_first=0.5), timeout=10)
    codes, errors, stop = [], [], threading.Event()

    def poison() -> None:
        while not stop.is_set() or len(errors) < 3:  # a few rounds even if the node finished first
            try:
                stub.Verify(verify_pb2.VerifyRequest(k=-1, items=[verify_pb2.VerifyItem(session_id="poison")]), timeout=10)
            except grpc.RpcError as e:
                codes.append(e.code())
            reply = stub.Verify(verify_pb2.VerifyRequest(k=2, items=[verify_pb2.VerifyItem(
                session_id="poison", length=4, pending=[0], draft_tokens=[5, 6], u_accept=[float("nan"), 0.5],
                q=torch.full((2, tiny_target.config.vocab_size), -1.0).numpy().tobytes(), u_next=0.5)]), timeout=10)  # fmt: skip
            errors.append(reply.results[0].error)

    thread = threading.Thread(target=poison, daemon=True)
    thread.start()
    try:
        requests = [Request(p, max_new_tokens=16) for p in prompts(3, seed=5)]
        remote = remote_engine(tiny_draft, tokenizer, server.address, EngineConfig(max_batch_size=3, max_len=MAX_LEN, k=2))
        outs = remote.generate(requests)
    finally:
        stop.set()
        thread.join(10)
    assert [o.token_ids for o in outs] == [o.token_ids for o in fused(tiny_target, tiny_draft, tokenizer, requests, batch=3, k=2)]
    assert codes and set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}
    assert errors and all(e for e in errors)  # its own item refused, every time


def _self_signed() -> tuple[bytes, bytes]:
    """A throwaway certificate for 127.0.0.1 and localhost: (PEM certificate, PEM private key)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))  # fmt: skip
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), pem_key


def test_token_and_tls_guard_the_target(tiny_target, tiny_draft, tokenizer, tmp_path):
    """With a token and TLS: a draft node without the token is refused (UNAUTHENTICATED, named in
    the error), one without TLS cannot talk to it, one with both gets the fused engine's output;
    Info names the model's folder, not its path; a message past the largest legitimate verify is
    refused."""
    import grpc

    from serving.distributed import verify_pb2, verify_pb2_grpc

    cert, key = _self_signed()
    config = EngineConfig(max_batch_size=2, max_len=MAX_LEN, k=3)
    requests = [Request(p, max_new_tokens=12) for p in prompts(2, seed=9)]
    with VerifyServer(tiny_target, tokenizer, name=str(tmp_path / "models" / "tiny-target"), max_batch_size=2, max_len=MAX_LEN,
                      k_buckets=(3,), token="s3cret", tls=(cert, key)) as server:  # fmt: skip
        with pytest.raises(TargetUnavailable, match="UNAUTHENTICATED.*grpc.token"):
            SpeculativeEngine(RemoteVerifier(server.address, timeout_s=5, tls_ca=cert), tokenizer, tiny_draft, config)
        with pytest.raises(TargetUnavailable, match="UNAUTHENTICATED"):
            SpeculativeEngine(RemoteVerifier(server.address, timeout_s=5, token="guess", tls_ca=cert), tokenizer, tiny_draft, config)
        with pytest.raises(TargetUnavailable, match="cannot be reached.*serves TLS.*grpc.tls_ca"):  # plaintext to a TLS port
            SpeculativeEngine(RemoteVerifier(server.address, timeout_s=2, token="s3cret"), tokenizer, tiny_draft, config)
        other, _ = _self_signed()
        with pytest.raises(TargetUnavailable, match="does not vouch for"):  # TLS with the wrong CA
            SpeculativeEngine(RemoteVerifier(server.address, timeout_s=2, token="s3cret", tls_ca=other), tokenizer, tiny_draft, config)
        verifier = RemoteVerifier(server.address, timeout_s=10, token="s3cret", tls_ca=cert)
        outs = SpeculativeEngine(verifier, tokenizer, tiny_draft, config).generate(requests)
        assert [o.token_ids for o in outs] == [o.token_ids for o in fused(tiny_target, tiny_draft, tokenizer, requests, k=3)]
        assert verifier.target_info.model == "tiny-target" and verifier.probe()

        channel = grpc.secure_channel(server.address, grpc.ssl_channel_credentials(root_certificates=cert))
        stub, auth = verify_pb2_grpc.VerifierStub(channel), (("authorization", "Bearer s3cret"),)
        V = tiny_target.config.vocab_size
        legit = 2 * 3 * V * 4  # the most q bytes a verify of this target carries
        with pytest.raises(grpc.RpcError) as info:
            stub.Verify(verify_pb2.VerifyRequest(k=3, items=[verify_pb2.VerifyItem(session_id="x", q=b"\0" * (legit + (2 << 20)))]),
                        timeout=10, metadata=auth)  # fmt: skip
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        channel.close()
    with VerifyServer(tiny_target, tokenizer, max_batch_size=2, max_len=MAX_LEN, k_buckets=(3,)) as plain:
        with pytest.raises(TargetUnavailable, match="does not serve TLS.*drop grpc.tls_ca"):  # TLS to a plaintext port
            SpeculativeEngine(RemoteVerifier(plain.address, timeout_s=2, tls_ca=cert), tokenizer, tiny_draft, config)


def test_a_node_at_its_session_cap_is_refused_while_another_is_admitted(tiny_target, tokenizer):
    """Per-node tokens give each draft node an identity: with 4 slots and two nodes, each may
    hold 2 sessions. Node a's third Open is refused (RESOURCE_EXHAUSTED, naming it) while node b
    is admitted; a closed session frees a's turn; an unknown token is refused."""
    import grpc

    from serving.distributed import verify_pb2, verify_pb2_grpc

    with VerifyServer(tiny_target, tokenizer, max_batch_size=4, max_len=MAX_LEN, k_buckets=(3,),
                      node_tokens={"a": "token-a", "b": "token-b"}) as server:  # fmt: skip
        assert server.service.max_sessions_per_node == 2
        channel = grpc.insecure_channel(server.address)
        stub = verify_pb2_grpc.VerifierStub(channel)

        def open_(node: str, sid: str):
            request = verify_pb2.OpenRequest(session_id=sid, prompt_ids=[5, 6, 7], max_new_tokens=4, k_max=3, u_first=0.5,
                                             sampling=verify_pb2.Sampling(temperature=0.0, top_p=1.0))  # fmt: skip
            return stub.Open(request, timeout=30, metadata=(("authorization", f"Bearer token-{node}"),))

        open_("a", "a1"), open_("a", "a2")
        with pytest.raises(grpc.RpcError) as info:
            open_("a", "a3")
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "'a' holds 2 sessions" in info.value.details()
        open_("b", "b1")  # the other node still gets a slot
        stub.Close(verify_pb2.CloseRequest(session_ids=["a1"]), timeout=30, metadata=(("authorization", "Bearer token-a"),))
        open_("a", "a3")
        with pytest.raises(grpc.RpcError) as info:
            open_("c", "c1")  # nobody's token
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel.close()


def test_a_threshold_request_on_a_draft_node_fails_alone_naming_the_setting(server, tiny_target, tiny_draft, tokenizer):
    """The target service verifies exactly (Open carries no threshold): a draft node refuses a
    threshold request by name instead of serving it exact under a lossy label; its neighbour runs."""
    from serving.engine import RequestFailed

    remote = remote_engine(tiny_draft, tokenizer, server.address, EngineConfig(max_batch_size=2, max_len=MAX_LEN, k=2))
    good, bad = prompts(2, seed=11)
    ok = remote.add_request(Request(good, max_new_tokens=8))
    lossy = remote.add_request(Request(bad, SamplingParams(verification="threshold"), max_new_tokens=8))
    finished, failed = {}, {}
    for _ in range(50):
        if not remote.has_unfinished_requests():
            break
        try:
            outs = remote.step()
        except RequestFailed as e:
            failed.update(e.errors)
            continue
        finished.update({o.request_id: o.finished for o in outs if o.finished is not None})
    assert set(failed) == {lossy} and "verification='threshold'" in str(failed[lossy])
    [expected] = fused(tiny_target, tiny_draft, tokenizer, [Request(good, max_new_tokens=8)], k=2)
    assert finished[ok].token_ids == expected.token_ids
