"""Fair admission (serving.server.admission): per-client limits, the fair queue the scheduler feeds
the engine from, and connections that send nothing. None of these depend on the machine's speed:
the scheduler runs over a fake engine whose slots the test frees by hand."""

from __future__ import annotations

import asyncio
import socket
import time
from types import SimpleNamespace

import pytest

from serving.engine import Request
from serving.server.admission import FairQueue, client_id
from serving.server.scheduler import Failed, Routed, Scheduler, Ticket


@pytest.mark.unit
def test_a_client_is_its_own_key_else_its_address():
    assert client_id({"authorization": "Bearer sk-alice"}, "10.0.0.1", None) == client_id({"authorization": "Bearer sk-alice"}, "10.0.0.2", None)
    assert client_id({"authorization": "Bearer sk-alice"}, "h", None) != client_id({"authorization": "Bearer sk-bob"}, "h", None)
    assert "sk-alice" not in client_id({"authorization": "Bearer sk-alice"}, "h", None)  # a 429 names it; never the key
    assert client_id({"authorization": "Bearer shared"}, "10.0.0.1", "shared") == "addr:10.0.0.1"  # the server's one key
    assert client_id({}, None, None) == "addr:unknown"


@pytest.mark.unit
def test_the_next_slot_goes_to_the_client_with_the_fewest_running():
    q = FairQueue(queue_limit=100, per_client_limit=5)
    item = lambda client, n: SimpleNamespace(client=client, n=n)  # noqa: E731
    hog = [item("hog", i) for i in range(5)]
    for h in hog:
        assert q.refusal("hog") is None
        q.push(h)
    assert q.refusal("hog")[0] == "rate_limit_exceeded" and "per_client_limit=5" in q.refusal("hog")[1] and q.refusal("a") is None
    assert q.pop() is hog[0] and q.pop() is hog[1]  # nobody else waits: the hog runs two
    a, b = item("a", 0), item("b", 0)
    q.push(a), q.push(b)
    assert q.pop() is a and q.pop() is b  # 0 running each against the hog's 2
    assert q.pop() is hog[2]  # 1 each against 2: the hog's line is the only one left
    q.ended(a), q.ended(b)
    a2 = item("a", 1)
    q.push(a2)
    assert q.pop() is a2 and q.held("hog") == 5 and len(q) == 2
    assert q.remove(hog[4]) and not q.remove(hog[4]) and q.held("hog") == 4 and list(q) == [hog[3]]
    q2 = FairQueue(queue_limit=1, per_client_limit=5)
    q2.push(item("x", 0))
    assert q2.refusal("y")[0] == "queue_full" and "queue_limit=1" in q2.refusal("y")[1]


class SlotEngine:
    """The engine's admission surface only: ``slots`` rows, requests recorded in the order they start."""

    def __init__(self, slots: int) -> None:
        self.slots, self.started, self.running = slots, [], set()
        self.config = SimpleNamespace(k=4, k_max=8)
        self.drafter_names = ("none",)

    num_waiting = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add_request(self, request: Request) -> int:
        assert len(self.running) < self.slots, "the scheduler fed a full engine"
        self.started.append(request)
        self.running.add(len(self.started) - 1)
        return len(self.started) - 1

    def abort_request(self, rid: int) -> bool:
        self.running.discard(rid)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)


@pytest.mark.unit
def test_a_client_holding_many_requests_neither_fills_the_queue_nor_goes_first():
    # One client sends 300 at once (per_client_limit 8 of a 64-place queue, 2 slots); 10 others then send one each.
    engine = SlotEngine(slots=2)
    sched = Scheduler(engine, max_batch_size=2, queue_limit=64, per_client_limit=8)
    loop = asyncio.new_event_loop()
    try:
        ticket = lambda client: Ticket(Request([1, 2, 3], max_new_tokens=4), "text", loop, client=client)  # noqa: E731
        hog, others = [ticket("key:hog") for _ in range(300)], [ticket(f"key:c{i}") for i in range(10)]
        sched._admit(hog)
        sched._admit(others)
        loop.run_until_complete(asyncio.sleep(0))  # deliver the events sent thread-safely
        first = {id(t): t.events.get_nowait() for t in [*hog, *others]}
        refused = [t for t in hog if isinstance(first[id(t)], Failed)]
        assert len(refused) == 292 and "per_client_limit=8" in first[id(refused[0])].error.message
        assert all(isinstance(first[id(t)], Routed) for t in others)  # every other client got in
        assert len(engine.started) == 2 and len(sched.waiting) == 16
        # The running requests end one at a time, oldest first: each freed slot goes to the fair queue's pick.
        by_request = {id(t.request): t.client for t in [*hog, *others]}
        while engine.running:
            rid = min(engine.running)
            sched._cancel(next(t for t in [*hog, *others] if t.request_id == rid))
            sched._feed()
        clients = [by_request[id(r)] for r in engine.started]
        assert clients == ["key:hog"] * 2 + [f"key:c{i}" for i in range(10)] + ["key:hog"] * 6, clients
        assert len(sched.waiting) == 0 and sched.waiting.held("key:hog") == 0
    finally:
        loop.close()


@pytest.mark.unit
def test_the_429_names_the_limit_that_refused_it():
    engine = SlotEngine(slots=1)
    sched = Scheduler(engine, max_batch_size=1, queue_limit=3, per_client_limit=2)
    loop = asyncio.new_event_loop()
    try:
        tickets = [Ticket(Request([1], max_new_tokens=2), "t", loop, client="addr:1.2.3.4") for _ in range(3)]
        tickets += [Ticket(Request([1], max_new_tokens=2), "t", loop, client=f"addr:{i}") for i in range(3)]
        sched._admit(tickets)
        loop.run_until_complete(asyncio.sleep(0))
        events = [t.events.get_nowait() for t in tickets]
    finally:
        loop.close()
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["Routed", "Routed", "Failed", "Routed", "Routed", "Failed"], kinds
    assert events[2].error.status == 429 and "client addr:1.2.3.4" in events[2].error.message
    assert "per_client_limit=2" in events[2].error.message and events[2].error.code == "rate_limit_exceeded"
    assert "queue_limit=3" in events[5].error.message and events[5].error.code == "queue_full"


@pytest.fixture(scope="module")
def idle_server(model_dirs, tmp_path_factory):
    from routing.router import Router
    from tests.test_server import LiveServer

    router = tmp_path_factory.mktemp("router") / "router.pt"
    Router.create({"draft": str(model_dirs["draft"])}, str(model_dirs["target"])).save(router)
    server = LiveServer([f"router={router}", "engine.max_len=128", "idle_timeout_s=1.0", "max_connections=300", "warmup=false"])
    server.wait_ready()
    yield server
    server.stop()


@pytest.mark.integration
def test_connections_that_send_nothing_are_closed_and_open_ones_are_capped(idle_server):
    host, port = idle_server.url.removeprefix("http://").split(":")
    opened = time.monotonic()
    socks = [socket.create_connection((host, int(port)), timeout=30) for _ in range(200)]
    try:
        assert idle_server.request("GET", "/health")[0] == 200  # 201 open: under the cap, served
        for s in socks:  # each is closed by the server (EOF), none sent a byte
            assert s.recv(1) == b""
        waited = time.monotonic() - opened
        assert waited >= 1.0, waited  # not before the timeout
        more = [socket.create_connection((host, int(port)), timeout=30) for _ in range(300)]  # at the cap
        try:
            status, body = idle_server.request("GET", "/health")
            assert status == 503, (status, body)
        finally:
            for s in more:
                s.close()
    finally:
        for s in socks:
            s.close()
