"""``serve --backend vllm``: Choral's front over pools of replicas, with stand-in replicas
(tests/fleet_stub.py: vLLM's endpoints and metric names) in their own processes, driven by the
official ``openai`` client. The real vLLM runs in tests/test_vllm_fleet.py (marker ``vllm``)."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml

from serving.config import ConfigError, load_config
from serving.fleet.fleet_file import FleetConfig, PoolSettings
from serving.server import cli_serve
from serving.server.vllm_backend import Replica, Route, pool_speedup
from tests.conftest import load_script
from tests.test_server import LiveServer
from tests.test_server import router_file as fleet_router  # noqa: F401 (a fixture: an untrained router, drafters code and chat)

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stub:
    """One stand-in replica in its own process (so a test can kill it)."""

    def __init__(self, model: str, name: str, spec: bool, delay: float = 0.002, hold: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "tests.fleet_stub", "--port", str(self.port), "--model", model, "--name", name,
                "--delay", str(delay)] + (["--spec"] if spec else []) + (["--hold", str(hold)] if hold else [])  # fmt: skip
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=1).read()
                return
            except OSError:
                assert self.proc.poll() is None and time.time() < deadline, "the stub replica did not start"
                time.sleep(0.1)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def running(self) -> int:
        """Completions the replica has running now (its vllm:num_requests_running)."""
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
        return int(float(next(line.split()[-1] for line in text.splitlines() if line.startswith("vllm:num_requests_running"))))

    def wait_running(self, n: int, timeout: float = 60.0) -> None:
        """Wait for the event (n completions running here), not for a guess at how long it takes."""
        deadline = time.time() + timeout
        while self.running() < n:
            assert self.proc.poll() is None and time.time() < deadline, f"{n} requests never ran on {self.url}"
            time.sleep(0.02)


def write_fleet(path: Path, model: str, pools: list[dict], **extra) -> Path:
    path.write_text(yaml.safe_dump({"model": model, "health_interval_s": 0.2, "pools": pools, **extra}))
    return path


def spec_pool(name: str, urls: list[str], **kw) -> dict:
    # step_cost 0.5: the drafting pool is predicted faster than the target alone for any acceptance.
    return {"name": name, "drafter": "code", "replicas": urls, "step_cost": 0.5,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 4}, **kw}  # fmt: skip


def front(fleet: Path, router: Path, *extra: str) -> LiveServer:
    srv = LiveServer(["backend=vllm", f"fleet={fleet}", f"router={router}", *extra])
    srv.wait_ready(60)
    return srv


@pytest.mark.unit
def test_fleet_file_errors_name_the_pool_and_the_fix(tmp_path):
    ok = {"name": "p", "replicas": ["http://127.0.0.1:1"]}
    cases = [
        ({"model": "m", "pools": []}, "pools is empty"),
        ({"model": "m", "pools": [ok, ok]}, "pool names repeat"),
        ({"model": "m", "pools": [{"name": "p", "replicas": ["127.0.0.1:8000"]}]}, "is not a base URL"),
        ({"model": "m", "pools": [{"name": "p", "drafter": "code", "replicas": ["http://h:1"]}]}, "drafts exactly when"),
        ({"model": "m", "pools": [spec_pool("p", ["http://h:1"], speculative_config={"method": "magic", "num_speculative_tokens": 4})]},
         "must be one of"),
        ({"model": "m", "pools": [spec_pool("p", ["http://h:1"], speculative_config={"method": "draft_model", "num_speculative_tokens": 4})]},
         "needs speculative_config.model"),
        ({"model": "m", "pools": [spec_pool("p", ["http://h:1"], speculative_config={"method": "ngram", "num_speculative_tokens": 0})]},
         "num_speculative_tokens=0"),
    ]  # fmt: skip
    for raw, message in cases:
        path = tmp_path / "fleet.yaml"
        path.write_text(yaml.safe_dump(raw))
        with pytest.raises(ConfigError, match=message):
            load_config(FleetConfig, path)


@pytest.mark.unit
def test_pool_speedup_and_the_pick_follow_rank_then_load():
    plain = PoolSettings(name="plain", replicas=["http://a:1"])
    spec = PoolSettings(name="spec", drafter="code", replicas=["http://b:1", "http://c:1"], max_inflight=2, step_cost=1.2,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 4})  # fmt: skip
    assert pool_speedup(plain, 0.9, 4) == 1.0
    # An acceptance rate of 1 commits K + 1 tokens a step; 0 commits 1 (the target's own token).
    assert pool_speedup(spec, 1.0, 4) == pytest.approx(5 / 1.2, rel=1e-3)
    assert pool_speedup(spec, 0.0, 4) == pytest.approx(1 / 1.2, rel=1e-3)
    assert pool_speedup(spec, 0.3, 4) < pool_speedup(spec, 0.6, 4)

    from serving.server.vllm_backend import FleetServer

    server = FleetServer.__new__(FleetServer)  # only the replica table: no config, no network
    server.replicas = [Replica("http://a:1", plain, 0, up=True, checked=True),
                       Replica("http://b:1", spec, 0, up=True, checked=True, inflight=1),
                       Replica("http://c:1", spec, 1, up=True, checked=True)]  # fmt: skip
    route = Route([(spec, 2.0), (plain, 1.0)])
    assert server._pick(route, set())[0].url == "http://c:1"  # the least-loaded replica of the first pool
    server.replicas[2].vllm_load = 2  # vLLM's own queue counts too: c is full, b has room
    assert server._pick(route, set())[0].url == "http://b:1"
    server.replicas[1].inflight = 2
    replica, passed = server._pick(route, set())
    assert replica.url == "http://a:1" and passed == [{"pool": "spec", "reason": "saturated"}]
    server.replicas[0].inflight = 8  # every replica full: the best-ranked pool queues it (vLLM's own queue)
    replica, passed = server._pick(route, set())
    assert replica.pool is spec and passed == []
    server.replicas[1].up = server.replicas[2].up = False
    assert server._pick(route, set()) == (server.replicas[0], [{"pool": "spec", "reason": "down"}])
    for r in server.replicas:
        r.up = False
    assert server._pick(route, set()) == (None, [{"pool": "spec", "reason": "down"}, {"pool": "plain", "reason": "down"}])


@pytest.mark.unit
def test_with_a_profile_a_busy_drafting_pool_gives_way_to_the_target_alone(tmp_path):
    from serving.fleet.profile import CostModel, DomainProfile, DraftProfile, Profile
    from serving.server.vllm_backend import FleetServer, load_fleet_profile

    plain = PoolSettings(name="plain", replicas=["http://a:1"])
    spec = PoolSettings(name="spec", drafter="base", replicas=["http://b:1"],
                        speculative_config={"method": "draft_model", "model": "d", "num_speculative_tokens": 4})  # fmt: skip
    # The VNNI VM's measured vLLM profile, rounded: a target step 100 ms + 12 ms per token fed,
    # a draft forward 50 ms. Alone, 4 drafts + a 5-token verify cost 360 ms, 3.2x a plain step.
    profile = Profile(target=CostModel(base_ms=100.0, per_token_ms=12.0),
                      drafts={"base": DraftProfile(cost=CostModel(base_ms=50.0), acceptance={"all": [0.9, 0.8, 0.7, 0.6]})},
                      domains={"all": DomainProfile()})  # fmt: skip
    server = FleetServer.__new__(FleetServer)  # the replica table and the profile: no config, no network
    server.profile = profile
    server.replicas = [Replica("http://a:1", plain, 0, up=True, checked=True),
                       Replica("http://b:1", spec, 0, up=True, checked=True)]  # fmt: skip

    def route() -> Route:  # 4 tokens a step for this prompt; ranked by the lone step first
        return Route([(spec, 1.2), (plain, 1.0)], tokens={"spec": 4.0, "plain": 1.0})

    # Both idle: spec's 4 tokens per 360 ms beat plain's 1 per 112 ms (scores in tokens per lone
    # plain step: what the request adds to its pool's throughput).
    r = route()
    assert server._pick(r, set())[0].pool is spec
    assert dict((p.name, s) for p, s in r.at_load) == pytest.approx({"spec": 4 * 112 / 360, "plain": 1.0})
    # spec busy with 6 requests: 7 rows step in 300 + 60 x 7 = 720 ms against 660 for 6. The
    # request adds 4 x 7/720 - 4 x 6/660 tokens a ms to spec's replica, a quarter of what it adds
    # to the idle target-alone pool, which takes it.
    server.replicas[1].inflight = 6
    r = route()
    assert server._pick(r, set())[0].pool is plain and [p.name for p, _ in r.at_load] == ["plain", "spec"]
    assert dict((p.name, s) for p, s in r.at_load)["spec"] == pytest.approx(4 * 112 * (7 / 720 - 6 / 660))
    assert [p.name for p, _ in r.ranked] == ["spec", "plain"]  # the lone ranking is kept: a retry starts from it
    # plain busy too (vLLM's own queue counts): 8 rows there add 8/196 - 7/184 per ms, still more
    # than spec's seventh row; with spec at 3 requests instead, its fourth row adds more.
    server.replicas[0].vllm_load = 7
    assert server._pick(route(), set())[0].pool is plain
    server.replicas[1].inflight = 3
    assert server._pick(route(), set())[0].pool is spec
    # A forced pool is not re-ranked, and without the router's tokens the lone order stands.
    server.replicas[1].inflight = 6
    server.replicas[0].vllm_load = 0
    assert server._pick(Route([(spec, 1.0)], forced=True), set())[0].pool is spec
    assert server._pick(Route([(spec, 1.2), (plain, 1.0)]), set())[0].pool is spec

    # A measured whole step of the pool (bench_vllm_fleet.py profile at 1 and 8 rows) replaces the
    # composed one: 200 + 100 ms a row, so 300 ms alone (less than the 360 composed). Alone, spec
    # adds 4 tokens per 300 ms; with 1 busy row its second row adds 4 x (2/400 - 1/300) per ms,
    # less than the idle plain pool's 1 per 112.
    profile.drafts["base"].step, profile.drafts["base"].step_k = CostModel(base_ms=200.0, per_token_ms=100.0), 2
    server.replicas[1].inflight = 0
    r = route()  # measured at K 2, this pool drafts 4: the composed step stands
    assert server._pick(r, set())[0].pool is spec and dict((p.name, s) for p, s in r.at_load)["spec"] == pytest.approx(4 * 112 / 360)
    profile.drafts["base"].step_k = 4
    r = route()
    assert server._pick(r, set())[0].pool is spec and dict((p.name, s) for p, s in r.at_load)["spec"] == pytest.approx(4 * 112 / 300)
    server.replicas[1].inflight = 1
    r = route()
    assert server._pick(r, set())[0].pool is plain
    assert dict((p.name, s) for p, s in r.at_load)["spec"] == pytest.approx(4 * 112 * (2 / 400 - 1 / 300))
    # At max_inflight a request would wait in vLLM's queue: the full pool adds nothing now.
    server.replicas[1].inflight = 8
    r = route()
    assert server._pick(r, set())[0].pool is plain and dict((p.name, s) for p, s in r.at_load)["spec"] == 0.0
    profile.drafts["base"].step, profile.drafts["base"].step_k = None, None

    # A fleet whose model-drafting pool the profile has no cost for is refused, naming both.
    fleet = {"model": "m", "profile": str(profile.save(tmp_path / "p.yaml")),
             "pools": [{"name": "plain", "replicas": ["http://a:1"]},
                       {"name": "code-pool", "drafter": "code", "replicas": ["http://b:1"],
                        "speculative_config": {"method": "draft_model", "model": "d", "num_speculative_tokens": 4}}]}  # fmt: skip
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet))
    with pytest.raises(ConfigError, match=r"code-pool.*has no cost for \(it has \['base'\]\)"):
        load_fleet_profile(load_config(FleetConfig, path))
    assert cli_serve.main(["--backend", "vllm", "--fleet", str(path)]) == 2  # serve says so and exits
    fleet["profile"] = str(tmp_path / "missing.yaml")
    path.write_text(yaml.safe_dump(fleet))
    with pytest.raises(ConfigError, match=r"missing.yaml does not exist .*bench_vllm_fleet.py profile"):
        load_fleet_profile(load_config(FleetConfig, path))


@pytest.mark.e2e
def test_the_front_routes_streams_forces_and_counts_per_pool(model_dirs, fleet_router, tmp_path):
    model = str(model_dirs["target"])
    plain, spec = Stub(model, "plain", spec=False), Stub(model, "spec", spec=True)
    fleet = write_fleet(tmp_path / "fleet.yaml", model, [{"name": "plain", "replicas": [plain.url]},
                                                        spec_pool("spec", [spec.url])])  # fmt: skip
    srv = front(fleet, fleet_router)
    try:
        c = srv.client
        assert srv.model == Path(model).name  # a folder's name, never its path
        out = c.completions.create(model=srv.model, prompt="def add(a, b):", max_tokens=5, temperature=0)
        assert out.choices[0].text == "".join(f"spec{i} " for i in range(5)) and out.model == srv.model
        choral = out.model_extra["choral"]
        assert choral["pool"] == "spec" and choral["draft"] == "code" and choral["num_speculative_tokens"] == 4
        assert choral["predicted_speedup"]["spec"] > choral["predicted_speedup"]["plain"] == 1.0
        # Forced to the target alone (body field; the header works the same), streamed, chat.
        chat = c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         extra_body={"draft": "none"})  # fmt: skip
        assert chat.choices[0].message.content == "plain0 plain1 plain2 plain3 " and chat.model_extra["choral"]["forced"]
        chunks = list(c.completions.create(model=srv.model, prompt="x", max_tokens=6, stream=True,
                                           extra_headers={"X-Choral-Draft": "plain"}))  # fmt: skip
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "".join(f"plain{i} " for i in range(6))
        assert chunks[-1].model_extra["choral"]["pool"] == "plain" and all(ch.usage is None for ch in chunks)
        with_usage = list(c.completions.create(model=srv.model, prompt="x", max_tokens=3, stream=True,
                                               stream_options={"include_usage": True}))  # fmt: skip
        assert with_usage[-1].usage.completion_tokens == 3
        # Errors: ours (the same as the choral backend's) and the replica's own, passed through.
        for kwargs, status, text in [
            (dict(model="other", prompt="x"), 404, "does not exist"),
            (dict(model=srv.model, prompt="x", extra_body={"draft": "eagle"}), 400, "unknown draft 'eagle'"),
            (dict(model=srv.model, prompt="x", top_p=2.0), 400, "top_p"),
            (dict(model=srv.model, prompt="x", max_tokens=5000), 400, "max_tokens is too large"),
        ]:
            with pytest.raises(openai.APIStatusError) as e:
                c.completions.create(**kwargs)
            assert e.value.status_code == status and text in str(e.value), (kwargs, e.value)
        models = c.models.list().data[0].model_extra["choral"]
        assert models["pools"]["spec"]["replicas_up"] == 1 and models["pools"]["plain"]["drafter"] == "none"
        m = srv.metrics()
        assert m[("choral_pool_requests_total", (("pool", "spec"), ("status", "200")))] == 2
        assert m[("choral_pool_requests_total", (("pool", "plain"), ("status", "200")))] == 2
        assert m[("choral_pool_requests_total", (("pool", "spec"), ("status", "400")))] == 1
        assert m[("choral_pool_generated_tokens_total", (("pool", "plain"),))] == 10
        assert m[("choral_replica_up", (("pool", "spec"), ("replica", "0")))] == 1
    finally:
        srv.stop()
        plain.kill()
        spec.kill()


@pytest.mark.e2e
def test_a_killed_replica_fails_only_its_requests_and_traffic_moves_on(model_dirs, fleet_router, tmp_path):
    model = str(model_dirs["target"])
    # The spec replica's answers never finish (its hold file is never made): it dies mid-request
    # whatever the machine's speed.
    plain, spec = Stub(model, "plain", spec=False, delay=0.02), Stub(model, "spec", spec=True, hold=tmp_path / "never")
    fleet = write_fleet(tmp_path / "fleet.yaml", model, [{"name": "plain", "replicas": [plain.url]},
                                                        spec_pool("spec", [spec.url], max_inflight=16)])  # fmt: skip
    srv = front(fleet, fleet_router, "request_timeout_s=120")
    try:
        c = srv.client

        def run(job: tuple[str, bool]) -> str:
            draft, stream = job
            try:
                if stream:
                    text = "".join(ch.choices[0].text for ch in c.completions.create(
                        model=srv.model, prompt="p", max_tokens=150, stream=True, extra_body={"draft": draft}) if ch.choices)  # fmt: skip
                    return "ok" if text.startswith(draft) and len(text.split()) == 150 else f"short:{len(text.split())}"
                out = c.completions.create(model=srv.model, prompt="p", max_tokens=150, extra_body={"draft": draft})
                return "ok" if len(out.choices[0].text.split()) == 150 else "short"
            except (openai.APIError, openai.APIConnectionError) as e:
                return f"error:{getattr(e, 'status_code', None)}:{e}"

        jobs = [("spec", i % 2 == 0) for i in range(6)] + [("plain", i % 2 == 0) for i in range(4)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(run, j) for j in jobs]
            spec.wait_running(6)  # every spec request is on its replica
            spec.kill()
            results = [f.result(timeout=120) for f in futures]  # none hangs
        assert results[6:] == ["ok"] * 4, results  # the plain pool's requests are untouched
        assert all(r.startswith("error:") for r in results[:6]), results
        assert any("failed mid-request" in r for r in results[:6]), results
        # The next requests, ranked to the dead pool, go to the next pool, and say so.
        out = c.completions.create(model=srv.model, prompt="def f():", max_tokens=3)
        assert out.model_extra["choral"]["pool"] == "plain"
        assert out.model_extra["choral"]["fallback"] == [{"pool": "spec", "reason": "down"}]
        with pytest.raises(openai.APIStatusError, match="the forced pool is down") as e:  # forced to the dead pool
            c.completions.create(model=srv.model, prompt="x", max_tokens=3, extra_body={"draft": "code"})
        assert e.value.status_code == 503
        m = srv.metrics()
        assert m[("choral_pool_requests_total", (("pool", "spec"), ("status", "502")))] == 6
        assert m[("choral_pool_fallbacks_total", (("pool", "spec"), ("reason", "down")))] >= 1
    finally:
        srv.stop()
        plain.kill()


@pytest.mark.e2e
def test_a_saturated_pool_sends_the_request_to_the_next(model_dirs, fleet_router, tmp_path):
    model = str(model_dirs["target"])
    release = tmp_path / "release"  # the spec replica's one request runs until the test makes this file
    plain, spec = Stub(model, "plain", spec=False), Stub(model, "spec", spec=True, hold=release)
    fleet = write_fleet(tmp_path / "fleet.yaml", model, [{"name": "plain", "replicas": [plain.url]},
                                                        spec_pool("spec", [spec.url], max_inflight=1)])  # fmt: skip
    srv = front(fleet, fleet_router)
    try:
        def run(_):
            return srv.client.completions.create(model=srv.model, prompt="p", max_tokens=50).model_extra["choral"]

        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(run, 0)
            try:
                spec.wait_running(1)  # the spec pool is at its max_inflight
                second = run(1)
            finally:
                release.touch()
        assert first.result()["pool"] == "spec"
        assert second["pool"] == "plain" and second["fallback"] == [{"pool": "spec", "reason": "saturated"}]
    finally:
        srv.stop()
        plain.kill()
        spec.kill()


@pytest.mark.unit
def test_streams_whose_clients_leave_at_once_give_their_replica_back(model_dirs, fleet_router, tmp_path):
    """A streaming client that hangs up before its first chunk: the front must still count the
    request off its replica (a leaked count makes the replica look busy, then saturated, forever)."""
    model = str(model_dirs["target"])
    plain = Stub(model, "plain", spec=False, delay=0.05)
    fleet = write_fleet(tmp_path / "fleet.yaml", model, [{"name": "plain", "replicas": [plain.url], "max_inflight": 3}])
    srv = front(fleet, fleet_router)
    port = int(srv.url.rsplit(":", 1)[1])
    body = json.dumps({"model": srv.model, "prompt": "p", "max_tokens": 50, "stream": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nAuthorization: Bearer x\r\n\r\n").encode() + body  # fmt: skip

    def metric(prefix: str) -> float:
        text = urllib.request.urlopen(f"{srv.url}/metrics", timeout=10).read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))

    def load() -> float:
        return metric("choral_replica_load{")

    try:
        for _ in range(6):  # twice max_inflight: a leak would saturate the pool
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(request)
            time.sleep(0.05)
        # Wait for the outcome, not for the load alone: on a busy machine the load is still 0 before
        # the front has taken the requests up at all.
        hung_up = 'choral_pool_requests_total{pool="plain",status="499"}'
        deadline = time.time() + 30
        while (metric(hung_up) < 6 or load() > 0) and time.time() < deadline:
            time.sleep(0.2)
        assert load() == 0
        assert metric(hung_up) == 6  # every hang-up counted off
        out = srv.client.completions.create(model=srv.model, prompt="p", max_tokens=5)
        assert out.model_extra["choral"]["fallback"] == []  # the pool is not taken for saturated
    finally:
        srv.stop()
        plain.kill()


@pytest.mark.e2e
def test_a_replica_with_the_wrong_config_is_never_used(model_dirs, fleet_router, tmp_path):
    model = str(model_dirs["target"])
    wrong = Stub(model, "wrong", spec=False)  # listed in a drafting pool, but it does not draft
    fleet = write_fleet(tmp_path / "fleet.yaml", model, [spec_pool("spec", [wrong.url])])
    srv = LiveServer(["backend=vllm", f"fleet={fleet}", f"router={fleet_router}"])
    try:
        deadline = time.time() + 30
        while "does not draft" not in srv.request("GET", "/health")[1]:
            assert time.time() < deadline, srv.request("GET", "/health")
            time.sleep(0.1)
        status, body = srv.request("GET", "/health")
        assert status == 503 and "spec/0" in body and "relaunch it with the pool's config" in body
        status, body = srv.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": "x"}).encode())
        assert status == 503
    finally:
        srv.stop()
        wrong.kill()


@pytest.mark.integration
def test_serve_checks_the_fleet_against_the_router(fleet_router, tmp_path, capsys):
    fleet = write_fleet(tmp_path / "fleet.yaml", "m", [spec_pool("spec", ["http://127.0.0.1:1"], drafter="math")])
    assert cli_serve.main(["--backend", "vllm", "--fleet", str(fleet), "--router", str(fleet_router)]) == 2
    err = capsys.readouterr().err
    assert "pool 'spec' has drafter='math'" in err and "chat, code, none" in err
    assert cli_serve.main(["--backend", "vllm", "--router", str(fleet_router)]) == 2
    assert "needs a fleet file: pass --fleet" in capsys.readouterr().err


@pytest.mark.integration
def test_export_vllm_writes_every_replica_of_a_fleet(model_dirs, tmp_path):
    target, draft = str(model_dirs["target"]), str(model_dirs["draft"])
    fleet = write_fleet(tmp_path / "fleet.yaml", target, [
        {"name": "plain", "replicas": ["http://127.0.0.1:8101", "http://10.0.0.2:8101"]},
        {"name": "draft", "drafter": "code", "replicas": ["http://127.0.0.1:8102"],
         "speculative_config": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}},
    ])  # fmt: skip
    out = tmp_path / "launch"

    module = load_script("scripts/export_vllm.py")

    def export(*extra: str) -> subprocess.CompletedProcess:
        """The script's main in this process (a process each paid ~10 s of imports): its exit code and output."""
        args = ["--fleet", str(fleet), "--out", str(out), *extra]
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = module.main(args)
            except SystemExit as e:  # argparse's own errors
                code = e.code
        return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())

    # Once as the script it is, in its own process; every other case through its main.
    ran = subprocess.run([sys.executable, "scripts/export_vllm.py", "--fleet", str(fleet), "--out", str(out), "--platform", "cpu",
                          "--cpus-per-replica", "1"], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert ran.returncode == 0, ran.stderr  # host cores unknown: consecutive
    local, remote, drafting = (out / n for n in ("plain-0.sh", "plain-1.sh", "draft-0.sh"))
    # Replicas on one host get their own cores; a remote host starts again from core 0 and listens beyond loopback.
    assert "VLLM_CPU_OMP_THREADS_BIND=0-0" in local.read_text() and "--host 127.0.0.1 --port 8101" in local.read_text()
    assert "VLLM_CPU_OMP_THREADS_BIND=0-0" in remote.read_text() and "--host 0.0.0.0" in remote.read_text()
    assert "VLLM_CPU_OMP_THREADS_BIND=1-1" in drafting.read_text()
    # A host with fewer cores than its replicas need: ranges wrap round to core 0, and the script says so.
    assert export("--platform", "cpu", "--cpus-per-replica", "1", "--cpus-per-host", "1").returncode == 0
    assert "VLLM_CPU_OMP_THREADS_BIND=0-0" in drafting.read_text() and "shares cores 0-0" in drafting.read_text()
    assert "WARNING" not in local.read_text()
    too_wide = export("--platform", "cpu", "--cpus-per-replica", "3", "--cpus-per-host", "2")
    assert too_wide.returncode == 2 and "--cpus-per-replica 3 is more than a host's 2 cores" in too_wide.stderr
    assert export("--platform", "cpu", "--cpus-per-replica", "1", "--cpus-per-host", "4").returncode == 0
    spec = json.loads(drafting.read_text().split("--speculative-config ")[1].strip().strip("'"))
    assert spec == {"method": "draft_model", "model": str(Path(draft).resolve()), "num_speculative_tokens": 3}
    resolved = load_config(FleetConfig, out / "fleet.yaml")  # the front reads the copy it wrote
    assert resolved.served_model_name == "target" and resolved.pool("draft").speculative_config == spec
    assert export("--platform", "cuda", "--gpus-per-replica", "2").returncode == 0
    assert "CUDA_VISIBLE_DEVICES=2,3" in drafting.read_text() and "--tensor-parallel-size 2" in drafting.read_text()
    assert export("--platform", "neuron").returncode == 0
    assert "NEURON_RT_VISIBLE_CORES=2-3" in drafting.read_text() and "documents EAGLE3" in drafting.read_text()
    assert "--dtype" not in drafting.read_text()  # vLLM's own default unless asked
    assert export("--platform", "cpu", "--dtype", "float32").returncode == 0
    assert all("--dtype float32" in s.read_text() for s in (local, remote, drafting))
    # A draft with another tokenizer is refused here, where the error is clear.
    from tests.conftest import make_tokenizer

    other = tmp_path / "other"
    make_tokenizer(vocab_size=300).save_pretrained(other)
    (other / "config.json").write_text((Path(draft) / "config.json").read_text())  # a model folder, another vocabulary
    fleet.write_text(fleet.read_text().replace(draft, str(other)))
    failed = export()
    assert failed.returncode == 2 and "error: pool 'draft' draft" in failed.stderr and "Traceback" not in failed.stderr
