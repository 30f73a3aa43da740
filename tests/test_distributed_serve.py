"""End to end: `serve --role target` (a real process) and `serve --role draft` (the HTTP server
in this process) on loopback, driven by the official ``openai`` client: greedy output equals the
fused engine's; killing the target mid-stream gives the client a clean error; after a restart on
the same port requests succeed again without touching the draft node."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import openai
import pytest

from routing.router import Router
from serving.engine import EngineSettings, Request, load_engine
from serving.server.launch import free_port
from tests.test_server import LiveServer, StepGate

pytestmark = pytest.mark.e2e

MAX_LEN = 128


class TargetProcess:
    """``serve --role target`` as its own process."""

    def __init__(self, target_dir, port: int) -> None:
        self.address = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "serving.server.cli_serve", "--role", "target", "--port", str(port),
               f"target_model={target_dir}", "engine.device=cpu", f"engine.max_len={MAX_LEN}", "engine.max_batch_size=4", "log_level=warning"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 90
        with grpc.insecure_channel(self.address) as channel:
            while True:
                if self.proc.poll() is not None:
                    pytest.fail(f"serve --role target exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
                try:
                    grpc.channel_ready_future(channel).result(timeout=0.5)
                    return
                except grpc.FutureTimeoutError:
                    assert time.monotonic() < deadline, "serve --role target did not come up in 90 s"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def router_file(model_dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("router") / "router.pt"
    Router.create({"code": str(model_dirs["draft"])}, str(model_dirs["target"])).save(path)
    return path


@pytest.mark.slow  # a real serve --role target process, killed and restarted (~27 s); tests/test_distributed.py covers the protocol in-process
def test_serve_target_and_draft_roles_end_to_end(model_dirs, router_file):
    port = free_port()
    target = TargetProcess(model_dirs["target"], port)
    draft = None
    try:
        draft = LiveServer([f"router={router_file}", "role=draft", f"target_address={target.address}",
                            f"engine.max_len={MAX_LEN}", "engine.max_batch_size=2", "engine.k=4", "grpc.deadline_s=20"])  # fmt: skip
        draft.wait_ready(90)
        engine = draft.backend.models.engine
        assert engine.verifier.timeout_s == 20  # grpc.deadline_s: the deadline of every call to the target
        settings = EngineSettings(device="cpu", max_batch_size=1, max_len=MAX_LEN, k=4)
        fused = load_engine(settings, str(model_dirs["target"]), {"draft": str(model_dirs["draft"])}).engine
        prompt = "def add(a, b):"
        ids = fused.tokenizer.encode(prompt, add_special_tokens=False)
        [ref] = fused.generate([Request(ids, max_new_tokens=24)])
        out = draft.client.completions.create(model=draft.model, prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == ref.text and out.usage.completion_tokens == len(ref.token_ids)
        assert out.model_extra["choral"]["draft"] == "code" and out.model_extra["choral"]["target_calls"] >= 1

        # Mid-stream: the target dies after the first tokens; the stream ends with an error event.
        # The draft node steps only when the gate lets it, so the stream cannot finish before the kill.
        reserve = draft.backend.models.reserve  # K + 1 of the largest K a request may draft
        budget = MAX_LEN - len(ids) - reserve - 1
        gate = StepGate(draft.backend.scheduler)
        stream = draft.client.completions.create(model=draft.model, prompt=prompt, max_tokens=budget, temperature=0,
                                                 stream=True, extra_body={"draft": "none"})  # fmt: skip
        gate.allow(1)
        chunks = iter(stream)
        received = [next(chunks).choices[0].text]
        target.kill()
        gate.open()
        with pytest.raises(openai.APIError, match="(?i)target.*unavailable"):
            for chunk in chunks:
                received.append(chunk.choices[0].text)
        assert 0 < len(received) < budget
        with pytest.raises(openai.APIStatusError) as e:  # while it is down: 503, naming the address
            draft.client.completions.create(model=draft.model, prompt=prompt, max_tokens=8, temperature=0)
        assert e.value.status_code == 503 and target.address in e.value.message
        with pytest.raises(openai.APIStatusError) as e:  # a stream too: 503 up front, not 200 then an error event
            draft.client.completions.create(model=draft.model, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        assert e.value.status_code == 503 and e.value.code == "target_unavailable"
        status, text = draft.request("GET", "/health")  # a load balancer takes the node out
        assert status == 503 and target.address in text

        target = TargetProcess(model_dirs["target"], port)  # restarted: no sessions, same address
        assert draft.request("GET", "/health")[0] == 200
        again = draft.client.completions.create(model=draft.model, prompt=prompt, max_tokens=24, temperature=0)
        assert again.choices[0].text == ref.text
    finally:
        if draft is not None:
            draft.stop()
        target.kill()
