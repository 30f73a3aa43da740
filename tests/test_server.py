"""The OpenAI-compatible server, live on a loopback port (uvicorn in a thread), driven by the
official ``openai`` client, on tiny model folders and an untrained router."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from routing.router import Router
from serving.config import load_config
from serving.engine import EngineSettings, Request, load_engine
from serving.engine.request import TokenLogprob
from serving.server import cli_serve
from serving.server.app import create_app
from serving.server.connections import uvicorn_config
from serving.server.serve_config import ServeConfig
from serving.server.server import EngineServer, load_models
from serving.tools import cli_generate
from tests.conftest import load_script

MAX_LEN = 128
CHAT = [{"role": "user", "content": "What is 12 + 30?"}]


class LiveServer:
    """``serving.server.app.create_app`` under a real uvicorn on a free loopback port, over the
    backend the config names (``load``: how the engine backend loads its models)."""

    def __init__(self, overrides: list[str], load=load_models) -> None:
        self.cfg = load_config(ServeConfig, None, ["engine.device=cpu", "log_level=warning", *overrides])
        if self.cfg.backend == "vllm":
            from serving.server.vllm_backend import FleetServer  # httpx: only the fleet's tests need it

            self.backend = FleetServer(self.cfg)
        else:
            self.backend = EngineServer(self.cfg, load)
        self.app = create_app(self.backend, self.cfg)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn_config(self.app, self.cfg, host="127.0.0.1", port=port))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="test", max_retries=0, timeout=60)
        self.model = None

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while self.request("GET", "/health")[0] != 200:
            assert time.time() < deadline, f"not ready: {self.request('GET', '/health')}"
            time.sleep(0.05)
        self.model = self.client.models.list().data[0].id

    def request(self, method: str, path: str, data: bytes | None = None, headers: dict | None = None) -> tuple[int, str]:
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        status, text = self.request("GET", "/metrics")
        assert status == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}  # fmt: skip

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class StepGate:
    """Holds a live server's scheduler thread before each engine step until the test lets steps
    through: what a test asserts about a running request (it holds its slot, it outlives a
    client's timeout) then does not depend on how fast this machine makes tokens. It also counts
    the requests and client aborts that reached the scheduler, so a test waits for those events
    instead of sleeping."""

    def __init__(self, scheduler) -> None:
        self._cond = threading.Condition()
        self._permits, self._free = 0, False
        self.held = self.submits = self.aborts = 0
        step, submit, abort = scheduler._step, scheduler.submit, scheduler.abort

        def gated_step():
            with self._cond:
                self.held += 1
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._free or self._permits > 0)
                if not self._free:
                    self._permits -= 1
            step()

        def counting(call, name):
            def counted(ticket):
                call(ticket)
                with self._cond:
                    setattr(self, name, getattr(self, name) + 1)
                    self._cond.notify_all()
            return counted

        scheduler._step = gated_step
        scheduler.submit, scheduler.abort = counting(submit, "submits"), counting(abort, "aborts")

    def allow(self, steps: int = 1) -> None:
        with self._cond:
            self._permits += steps
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._free = True
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._free = False

    def wait(self, condition, what: str, timeout: float = 60.0) -> None:
        """Wait for ``condition(gate)``; the timeout only guards against a hang."""
        with self._cond:
            assert self._cond.wait_for(lambda: condition(self), timeout), f"waited {timeout:g} s for {what}"


@pytest.fixture(scope="module")
def router_file(model_dirs, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("router") / "router.pt"
    draft = str(model_dirs["draft"])
    Router.create({"code": draft, "chat": draft}, str(model_dirs["target"])).save(path)
    return path


@pytest.fixture(scope="module")
def live(router_file):
    """The main server (batch 4). Loading waits on a gate so the test sees /health before ready."""
    gate = threading.Event()

    def gated_load(cfg):
        assert gate.wait(60)
        return load_models(cfg)

    srv = LiveServer([f"router={router_file}", f"engine.max_len={MAX_LEN}", "engine.max_batch_size=4", "engine.k=4"], load=gated_load)
    srv.early = {path: srv.request(method, path, body) for method, path, body in (
        ("GET", "/health", None), ("GET", "/v1/models", None),
        ("POST", "/v1/completions", b'{"model": "m", "prompt": "hi"}'))}  # fmt: skip
    gate.set()
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(model_dirs):
    """The engine alone: what the server must reproduce for greedy requests."""
    settings = EngineSettings(device="cpu", max_batch_size=1, max_len=MAX_LEN, k=4)
    return load_engine(settings, str(model_dirs["target"]), {"draft": str(model_dirs["draft"])}).engine


def _chat_ids(engine, messages) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.e2e
def test_health_is_503_until_loaded_then_models_lists_drafts(live, model_dirs):
    status, body = live.early["/health"]
    assert status == 503 and json.loads(body)["status"] == "loading"
    for path in ("/v1/models", "/v1/completions"):
        status, body = live.early[path]
        assert status == 503 and "loading" in json.loads(body)["error"]["message"]
    assert live.request("GET", "/health") == (200, '{"status":"ok"}')
    [model] = live.client.models.list().data
    assert model.id == model_dirs["target"].name  # the folder's name: /v1/models never shows a filesystem path
    assert model.model_extra["choral"]["drafts"] == ["code", "chat", "ngram", "suffix", "grammar", "auto", "prediction", "none"]


@pytest.mark.e2e
def test_completion_greedy_matches_spec_generate(live, model_dirs, capsys):
    prompt = "def add(a, b):"
    out = live.client.completions.create(model=live.model, prompt=prompt, max_tokens=16, temperature=0)
    args = ["--target", str(model_dirs["target"]), "--draft", str(model_dirs["draft"]), "--prompt", prompt,
            "--max-new-tokens", "16", "--k", "4", "--device", "cpu", "--max-len", str(MAX_LEN), "--json"]  # fmt: skip
    assert cli_generate.main(args) == 0
    ref = json.loads(capsys.readouterr().out)
    assert out.choices[0].text == ref["text"]
    assert out.choices[0].finish_reason == ref["finish_reason"]
    assert out.usage.completion_tokens == len(ref["token_ids"])
    assert out.usage.prompt_tokens == len(model_tokens(live, prompt))
    choral = out.model_extra["choral"]
    assert choral["draft"] in ("code", "chat") and choral["forced"] is False and choral["router_choice"] == choral["draft"]
    assert 0.0 <= choral["acceptance_rate"] <= 1.0 and choral["tokens_per_target_call"] >= 1.0
    assert 0.0 < choral["predicted_acceptance"] < 1.0 and choral["suggested_k"] >= 1


def model_tokens(live, text: str) -> list[int]:
    return live.backend.models.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.e2e
def test_chat_greedy_matches_engine_and_stream_matches_non_stream(live, reference):
    [ref] = reference.generate([Request(_chat_ids(reference, CHAT), max_new_tokens=20)])
    out = live.client.chat.completions.create(model=live.model, messages=CHAT, max_tokens=20, temperature=0,
                                              extra_headers={"X-Choral-Draft": "none"})  # fmt: skip
    assert out.choices[0].message.content == ref.text and out.choices[0].message.role == "assistant"
    assert out.model_extra["choral"]["draft"] == "none" and out.model_extra["choral"]["forced"] is True
    assert out.usage.completion_tokens == len(ref.token_ids)

    chunks = list(live.client.chat.completions.create(model=live.model, messages=CHAT, max_tokens=20, temperature=0,
                                                      stream=True, stream_options={"include_usage": True},
                                                      extra_body={"draft": "code"}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    [last] = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert last.choices[0].finish_reason == ref.finish_reason
    assert last.model_extra["choral"]["draft"] == "code" and last.model_extra["choral"]["target_calls"] >= 1
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids) and chunks[-1].choices == []
    assert_token_origins(chunks, ref.token_ids, chat=True)


def assert_token_origins(chunks, token_ids: list[int], chat: bool) -> None:
    """Each text chunk's ``choral.tokens`` carry exactly its text, token by token, and together the
    answer's tokens in order, each with how it came (the first one from the target's prefill)."""
    entries = []
    for c in chunks:
        if not c.choices:
            continue
        text = (c.choices[0].delta.content if chat else c.choices[0].text) or ""
        tokens = (c.model_extra.get("choral") or {}).get("tokens", [])
        assert "".join(t["text"] for t in tokens) == text
        entries += tokens
    assert [t["id"] for t in entries] == token_ids
    assert entries[0]["origin"] == "target"
    assert all(t["origin"] in ("draft", "correction", "bonus", "target") for t in entries)
    assert all((t["drafter"] is not None) == (t["origin"] == "draft") for t in entries)


@pytest.mark.e2e
def test_stop_strings_streamed_and_not(live):
    full = live.client.completions.create(model=live.model, prompt="The quick brown", max_tokens=24, temperature=0)
    text = full.choices[0].text
    # A stop string taken from the middle of the greedy answer: the answer must end just before it.
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2)
                if text.find(text[i : i + 2]) == i and "\ufffd" not in text[i : i + 2])  # fmt: skip
    cut = live.client.completions.create(model=live.model, prompt="The quick brown", max_tokens=24, temperature=0,
                                         stop=[stop, "never appears"])  # fmt: skip
    assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"
    stream = live.client.completions.create(model=live.model, prompt="The quick brown", max_tokens=24, temperature=0,
                                            stop=stop, stream=True)  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == cut.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"
    for c in chunks:  # the stop string's own tokens may be cut from the text: the tokens still carry exactly it
        assert "".join(t["text"] for t in c.model_extra["choral"]["tokens"]) == c.choices[0].text


BAD = [
    # (endpoint, raw body or openai kwargs, status, param)
    ("completions", b'{"model": "m", "prompt": ', 400, None),
    ("chat", b'{"model": "MODEL", "max_tokens": 4}', 400, "messages"),
    ("chat", {"messages": []}, 400, "messages"),
    ("completions", {"model": "not-this-one"}, 404, "model"),
    ("chat", {"temperature": -0.5}, 400, "temperature"),
    ("completions", {"top_p": 0.0}, 400, "top_p"),
    ("completions", {"top_p": 1.5}, 400, "top_p"),
    ("completions", {"max_tokens": 1000}, 400, "max_tokens"),
    ("completions", {"prompt": "word " * 200}, 400, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "word " * 200}]}, 400, "messages"),
    ("completions", {"extra_body": {"draft": "nonexistent"}}, 400, "draft"),
    ("chat", {"extra_headers": {"X-Choral-Draft": "nonexistent"}}, 400, "draft"),
    ("completions", {"n": 2}, 400, "n"),
    # Values that once passed validation and failed inside the engine step, taking the batch down:
    ("completions", {"seed": 2**64}, 400, "seed"),
    ("completions", {"temperature": 1.0, "extra_body": {"top_k": 2**63}}, 400, "top_k"),
    ("completions", b'{"model": "MODEL", "prompt": "x", "max_tokens": 4, "temperature": 1e999}', 400, "temperature"),
    ("completions", b'{"model": "MODEL", "prompt": "a\\ud800b", "max_tokens": 4}', 400, "prompt"),
    ("chat", b'{"model": "MODEL", "messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, "messages[0].content"),
    ("completions", b'{"model": "MODEL", "prompt": "x", "deep": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None),
    ("completions", b'{"model": "MODEL", "max_tokens": 4, "prompt": "' + b"word " * 500_000 + b'"}', 413, None),
    ("completions", {"prompt": "word " * 100_000}, 400, "prompt"),  # refused by its length, not tokenized
    # Lax coercions that answered what the client did not ask for, and features silently dropped:
    ("completions", b'{"model": "MODEL", "prompt": "x", "max_tokens": true}', 400, "max_tokens"),
    ("completions", b'{"model": "MODEL", "prompt": "x", "max_tokens": 4, "stream": "yes"}', 400, "stream"),
    ("completions", {"logprobs": 6}, 400, "logprobs"),  # OpenAI's completions take 0..5
    ("chat", {"functions": [{"name": "f", "parameters": {}}]}, 400, "functions"),  # OpenAI's deprecated form of tools
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"}, 400, "tool_choice"),
    # The second round of probes (issue 61): an integer of 4,301+ digits was a 500 from int();
    # booleans and strings were read as numbers; OpenAI fields that change the answer were dropped.
    ("completions", b'{"model": "MODEL", "prompt": "x", "max_tokens": 4, "seed": ' + b"9" * 5000 + b"}", 400, "seed"),
    ("completions", b'{"model": "MODEL", "prompt": [5, ' + b"7" * 4400 + b'], "max_tokens": 4}', 400, "prompt"),
    ("completions", b'{"model": "MODEL", "prompt": [true, 5], "max_tokens": 4}', 400, "prompt"),
    ("completions", b'{"model": "MODEL", "prompt": "x", "max_tokens": 4, "temperature": true}', 400, "temperature"),
    ("chat", b'{"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "top_p": "0.5"}', 400, "top_p"),
    ("completions", {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    # Issue 72: a response_format that is not one of OpenAI's shapes, or a schema that cannot compile.
    ("chat", {"response_format": {"type": "xml"}}, 400, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, 400, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such"}}}}, 400,
     "response_format"),
    # Issue 71: the logits processors and logprobs, refused outside OpenAI's (or vLLM's) ranges.
    ("completions", {"logit_bias": {"15": 101}}, 400, "logit_bias"),
    ("completions", {"logit_bias": {"x15": 5}}, 400, "logit_bias"),
    ("chat", {"logit_bias": {"100000": -100}}, 400, "logit_bias"),  # beyond the tokenizer's vocabulary
    ("chat", {"frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("completions", {"presence_penalty": -3}, 400, "presence_penalty"),
    ("completions", {"extra_body": {"min_p": 1.5}}, 400, "min_p"),
    ("chat", {"extra_body": {"repetition_penalty": 0}}, 400, "repetition_penalty"),
    ("chat", {"top_logprobs": 3}, 400, "top_logprobs"),  # without logprobs=true
    ("chat", {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("completions", {"echo": True}, 400, "echo"),
    ("completions", {"suffix": "return x"}, 400, "suffix"),
    ("chat", b'{"model": "MODEL", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', 400, "messages"),
    ("completions", {"stop": ["ok", "y" * 1_500_000]}, 400, "stop"),  # refused by its length before any step
    # Threshold verification is lossy: refused unless the server allows it (allow_lossy: false, the default).
    ("chat", {"extra_body": {"verification": "threshold"}}, 400, "verification"),
    ("completions", {"extra_body": {"verification": "fast"}}, 400, "verification"),
    ("completions", {"extra_body": {"verification_threshold": 0.0}}, 400, "verification_threshold"),
]

# The no-op values of the fields above ask for nothing and are accepted, as OpenAI's SDKs send some.
NO_OPS = [
    ("chat", {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"},
              "temperature": 0, "user": "someone", "metadata": {"k": "v"}}),
    ("completions", {"logprobs": None, "suffix": "", "top_p": 1, "extra_body": {"top_k": 0}}),
    ("chat", {"logprobs": False, "top_logprobs": 0, "extra_body": {"min_p": 0, "repetition_penalty": 1}}),
]


@pytest.mark.e2e
@pytest.mark.parametrize("endpoint,body,status,param", BAD)
def test_bad_input_gets_openai_error_naming_the_field(live, endpoint, body, status, param):
    if isinstance(body, bytes):
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        got, text = live.request("POST", path, body.replace(b"MODEL", live.model.encode()))
        error = json.loads(text)["error"]
    else:
        kwargs = {"model": live.model, "max_tokens": 4, **body}
        create = live.client.chat.completions.create if endpoint == "chat" else live.client.completions.create
        if endpoint == "chat":
            kwargs.setdefault("messages", CHAT)
        else:
            kwargs.setdefault("prompt", "hello")
        with pytest.raises(openai.APIStatusError) as info:
            create(**kwargs)
        got, error = info.value.status_code, info.value.body
    assert got == status
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert param.split("[")[0] in error["message"] or param == "model"
    # ... and the server keeps serving everyone else.
    assert live.client.completions.create(model=live.model, prompt="hi", max_tokens=2).choices[0].finish_reason


@pytest.mark.e2e
@pytest.mark.parametrize("endpoint,body", NO_OPS)
def test_no_op_values_of_unimplemented_fields_are_accepted(live, endpoint, body):
    assert _send(live, endpoint, body)[0] == 200


@pytest.mark.e2e
def test_a_client_gone_mid_upload_is_counted_499_not_500(live, caplog):
    """A client that sends half a body and closes: counted under 499 (nginx's label; no client
    reads it), one INFO line, no 500 and no traceback."""
    import socket

    key = ("choral_requests_total", (("endpoint", "completions"), ("status", "499")))
    before = live.metrics().get(key, 0.0)
    host, port = live.url.removeprefix("http://").split(":")
    with caplog.at_level("INFO", logger="choral.server"):
        for _ in range(3):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000\r\n\r\n{\"model\": ")  # fmt: skip
        deadline = time.monotonic() + 60  # only guards a hang: each close is seen within milliseconds
        while live.metrics().get(key, 0.0) < before + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    after = live.metrics()
    assert after.get(key, 0.0) == before + 3
    assert after.get(("choral_requests_total", (("endpoint", "completions"), ("status", "500"))), 0.0) == 0.0
    lines = [r for r in caplog.records if "closed the connection" in r.getMessage()]
    assert len(lines) == 3 and all(r.levelname == "INFO" and r.exc_info is None for r in lines)


def _send(live, endpoint: str, body) -> tuple[int, str | None]:
    """One request as a client sends it: (HTTP status, the answer's text or None)."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if isinstance(body, bytes):
        status, _ = live.request("POST", path, body.replace(b"MODEL", live.model.encode()))
        return status, None
    kwargs = {"model": live.model, "max_tokens": 4, **body}
    create = live.client.chat.completions.create if endpoint == "chat" else live.client.completions.create
    kwargs.setdefault("messages" if endpoint == "chat" else "prompt", CHAT if endpoint == "chat" else "hello")
    try:
        out = create(**kwargs)
    except openai.APIStatusError as e:
        return e.status_code, None
    if kwargs.get("stream"):
        chunks = list(out)
        return 200, "".join((c.choices[0].delta.content or "") if endpoint == "chat" else c.choices[0].text for c in chunks if c.choices)
    return 200, out.choices[0].message.content if endpoint == "chat" else out.choices[0].text


@pytest.mark.e2e
def test_wrong_method_is_405_with_allow(live):
    req = urllib.request.Request(live.url + "/v1/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 405 and info.value.headers["Allow"] == "POST"
    assert json.loads(info.value.read())["error"]["type"] == "invalid_request_error"


@pytest.mark.e2e
def test_two_hundred_mixed_requests_from_sixteen_clients(live):
    """Valid requests (greedy, seeded sampled, streamed, chat) interleaved with every bad input
    above, 200 in all from 16 concurrent clients: no 5xx, none lost, each bad one its 4xx, each
    good one its solo output, and choral_requests_total by endpoint and status equals the
    clients' tally exactly."""
    good = [("completions", {"prompt": "def add(a, b):", "max_tokens": 10, "temperature": 0}),
            ("completions", {"prompt": "The quick brown fox", "max_tokens": 10, "temperature": 0.8, "seed": 5}),
            ("completions", {"prompt": "import os", "max_tokens": 10, "temperature": 0, "stream": True}),
            ("chat", {"messages": CHAT, "max_tokens": 10, "temperature": 0}),
            ("chat", {"messages": CHAT, "max_tokens": 10, "temperature": 1.1, "seed": 9, "stream": True})]  # fmt: skip
    solo = [_send(live, endpoint, body) for endpoint, body in good]
    assert all(status == 200 and text for status, text in solo)
    jobs = [("good", i % len(good)) if i % 2 == 0 else ("bad", (i // 2) % len(BAD)) for i in range(200)]

    def counts() -> dict[tuple[str, str], float]:
        return {(dict(labels)["endpoint"], dict(labels)["status"]): v for (name, labels), v in live.metrics().items()
                if name == "choral_requests_total"}  # fmt: skip

    def run(job):
        kind, i = job
        endpoint, body = (good[i][0], good[i][1]) if kind == "good" else (BAD[i][0], BAD[i][1])
        return endpoint, *_send(live, endpoint, body)

    before = counts()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    after = counts()
    assert len(results) == 200
    tally: dict[tuple[str, str], int] = {}
    for (kind, i), (endpoint, status, text) in zip(jobs, results):
        tally[endpoint, str(status)] = tally.get((endpoint, str(status)), 0) + 1
        if kind == "good":
            assert (status, text) == solo[i], f"good request {good[i]} answered differently in the mix"
        else:
            assert status == BAD[i][2], f"bad request {BAD[i][:2]!r} got {status}"
    assert not any(status.startswith("5") for _, status in tally)
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in after if after.get(key, 0) != before.get(key, 0)}
    assert delta == tally


@pytest.mark.e2e
def test_two_hundred_fuzzed_bodies_beside_valid_neighbours(live):
    """Seeded random bodies (random fields, types, sizes; a few cut short) beside valid greedy
    neighbours: no 5xx, every neighbour's answer as it is alone, the counters equal the tally.
    ``scripts/fuzz_server.py`` runs the same generator on 2,000."""
    script = load_script("scripts/fuzz_server.py")
    assert script.fuzz(live.url, live.model, bodies=200) == []


@pytest.mark.e2e
def test_concurrent_requests_give_the_sequential_outputs(live):
    jobs = [
        dict(prompt="def add(a, b):"),
        dict(prompt="import os", extra_body={"draft": "none"}),
        dict(prompt="The quick brown fox", extra_body={"draft": "chat"}),
        dict(prompt="What is 12 + 30?", temperature=0.9, top_p=0.9, seed=11),
        dict(prompt="def add(a, b):", temperature=1.2, top_k=20, seed=3, extra_body={"draft": "code"}),
        dict(prompt="The lazy dog", stop=["o"]),
    ]

    def run(job):
        kwargs = dict(job)
        if "top_k" in kwargs:
            kwargs.setdefault("extra_body", {})["top_k"] = kwargs.pop("top_k")
        kwargs.setdefault("temperature", 0)
        out = live.client.completions.create(model=live.model, max_tokens=12, **kwargs)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens

    sequential = [run(job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        concurrent = list(pool.map(run, jobs))
    assert concurrent == sequential


@pytest.mark.e2e
def test_requests_are_counted_once_with_the_status_the_client_saw(live):
    """choral_requests_total counts a request when its response ends (it counted 200 at admission,
    so a request that later failed showed as 200)."""

    def counts() -> dict[str, float]:
        return {dict(labels)["status"]: v for (name, labels), v in live.metrics().items()
                if name == "choral_requests_total" and dict(labels)["endpoint"] == "completions"}  # fmt: skip

    before = counts()
    tally: dict[str, int] = {}
    for kwargs in [{}, {"stream": True}, {"top_p": 2.0}, {"seed": 2**64}, {"extra_body": {"draft": "nope"}}, {}]:
        try:
            out = live.client.completions.create(model=live.model, prompt="hi", max_tokens=3, **kwargs)
            if kwargs.get("stream"):
                list(out)
            tally["200"] = tally.get("200", 0) + 1
        except openai.APIStatusError as e:
            tally[str(e.status_code)] = tally.get(str(e.status_code), 0) + 1
    after = counts()
    assert {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)} == tally
    assert tally == {"200": 3, "400": 3}


@pytest.mark.e2e
def test_metrics_parse_as_prometheus_text(live):
    live.client.completions.create(model=live.model, prompt="hi", max_tokens=3, stream=True).close()
    live.client.completions.create(model=live.model, prompt="hi", max_tokens=3)
    m = live.metrics()
    assert m[("choral_requests_total", (("endpoint", "completions"), ("status", "200")))] >= 1
    assert m[("choral_time_to_first_token_seconds_count", ())] >= 1
    assert m[("choral_e2e_latency_seconds_count", ())] >= 1
    assert m[("choral_inter_token_latency_seconds_count", ())] >= 1
    assert sum(v for (name, _), v in m.items() if name == "choral_draft_choices_total") >= 2
    assert sum(v for (name, _), v in m.items() if name == "choral_generated_tokens_total") >= 3
    assert ("choral_queue_depth", ()) in m and ("choral_running_requests", ()) in m
    assert any(name == "choral_request_acceptance_rate_count" for name, _ in m)


@pytest.mark.e2e
def test_load_test_script_has_no_lost_or_malformed_responses(live, tmp_path):
    from serving.tools import load_test

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "def add(a, b):", "domain": "code"}\n{"text": "What is 12 + 30?"}\n'
                       '{"text": "The quick brown fox", "use_chat_template": false}\n')  # fmt: skip
    args = ["--url", live.url, "--concurrency", "4", "--requests", "8", "--max-tokens", "8", "--prompt-file",
            str(prompts), "--out", str(tmp_path / "load"), "--quiet", "--compare-sequential",
            "--profile", str(tmp_path / "p.yaml"), "--profile-base", str(Path(__file__).parents[1] / "configs/profiles/cpu_bundled.yaml")]  # fmt: skip
    assert load_test.main(args) == 0
    from serving.fleet.profile import load_profile

    assert set(load_profile(tmp_path / "p.yaml").domains) == {"prompts"}  # ids of a prompt file: <stem>/<i>
    report = json.loads((tmp_path / "load" / "load_test.json").read_text())
    for run in (report, report["sequential"]):
        assert run["n_requests"] == 8 and run["errors"] == 0 and run["n_ok"] == 8
        assert run["throughput_tokens_per_s"] > 0 and run["ttft_ms"]["p50"] > 0 and run["e2e_ms"]["p99"] > 0
        assert all(r["ok"] and r["completion_tokens"] >= 1 and r["draft"] for r in run["rows"])
    assert report["concurrency"] == 4 and report["sequential"]["concurrency"] == 1
    # Greedy: both runs produced the same texts for the same requests.
    assert [r["text"] for r in report["rows"]] == [r["text"] for r in report["sequential"]["rows"]]
    assert "| concurrent | 4 | 8 | 0 |" in (tmp_path / "load" / "load_test.md").read_text()
    assert load_test.main(["--url", "http://example.com:8000", "--quiet"]) == 2  # loopback only


@pytest.mark.e2e
def test_threshold_verification_when_allowed_says_it_is_not_exact(router_file, reference):
    """allow_lossy=true: a threshold request is served and marked (``exact: false``, counted by
    verification in /metrics); an exact request beside it is still the target's own answer."""
    srv = LiveServer([f"router={router_file}", f"engine.max_len={MAX_LEN}", "engine.max_batch_size=2", "engine.k=4",
                      "allow_lossy=true"])  # fmt: skip
    try:
        srv.wait_ready()
        [ref] = reference.generate([Request(_chat_ids(reference, CHAT), max_new_tokens=16)])
        kw = dict(model=srv.model, messages=CHAT, max_tokens=16, temperature=0)
        lossy = srv.client.chat.completions.create(**kw, extra_body={"draft": "code", "verification": "threshold",
                                                                     "verification_threshold": 0.001})  # fmt: skip
        exact = srv.client.chat.completions.create(**kw, extra_body={"draft": "code"})
        assert lossy.model_extra["choral"]["exact"] is False and exact.model_extra["choral"]["exact"] is True
        assert exact.choices[0].message.content == ref.text
        m = srv.metrics()
        assert m[("choral_verification_requests_total", (("verification", "threshold"),))] == 1
        assert m[("choral_verification_requests_total", (("verification", "exact"),))] == 1
    finally:
        srv.stop()


@pytest.mark.e2e
def test_full_queue_429_disconnect_frees_slot_and_timeout(router_file):
    """One slot, no queue: a second request while the first runs gets 429; closing the first
    stream cancels it and frees the slot; a request past its timeout gets a clean error. The
    engine steps only when the test lets it (StepGate), so none of this races the machine."""
    srv = LiveServer([f"router={router_file}", "engine.max_len=512", "engine.max_batch_size=1", "queue_limit=0", "warmup=false"])
    try:
        srv.wait_ready()
        gate = StepGate(srv.backend.scheduler)
        # Greedy throughout: sampled, the random tiny model ends "hi" at EOS after one token now and then.
        long = dict(model=srv.model, prompt="hi", max_tokens=480, temperature=0, extra_body={"draft": "none"})  # no EOS
        short = dict(model=srv.model, prompt="hi", max_tokens=2, temperature=0)
        stream = srv.client.completions.create(stream=True, **long)  # admitted: the answer's headers are out
        gate.allow(1)  # one step: the first token
        next(iter(stream))  # it holds the slot now, and cannot finish: no step runs until the gate lets it
        with ThreadPoolExecutor(1) as pool:
            submits = gate.submits
            second = pool.submit(srv.client.completions.create, **short, extra_body={"draft": "none"})
            gate.wait(lambda g: g.submits > submits, "the second request to reach the scheduler")
            gate.allow(1)  # one more step of the first; the scheduler then takes up the second
            with pytest.raises(openai.RateLimitError) as info:
                second.result()
        assert info.value.body["code"] == "queue_full" and "queue_limit" in info.value.body["message"]
        stream.close()
        gate.wait(lambda g: g.aborts == 1, "the closed stream's abort")
        gate.open()
        deadline = time.time() + 20
        while srv.metrics()[("choral_running_requests", ())] != 0:
            assert time.time() < deadline, "the disconnected request kept its slot"
            time.sleep(0.05)
        assert srv.metrics()[("choral_finished_requests_total", (("reason", "cancelled"),))] == 1
        assert srv.client.completions.create(**short).usage.completion_tokens == 2

        # A non-streaming client that gives up is noticed too: its request is cancelled. With the
        # gate closed no step runs, so the request is certain to outlive the client's timeout.
        gate.close()
        impatient = srv.client.with_options(timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(**long)
        gate.wait(lambda g: g.aborts == 2, "the abandoned request's abort")
        gate.open()
        deadline = time.time() + 20
        while srv.metrics()[("choral_finished_requests_total", (("reason", "cancelled"),))] != 2:
            assert time.time() < deadline, "the abandoned non-streaming request was not cancelled"
            time.sleep(0.05)
        assert srv.metrics()[("choral_running_requests", ())] == 0

        # Past request_timeout_s: each request is held at its first step until its time is up.
        srv.backend.cfg.request_timeout_s = 0.05
        for streamed in (False, True):
            gate.close()
            held = gate.held
            with ThreadPoolExecutor(1) as pool:
                if streamed:  # the same no-EOS request, streamed: the error comes as an event
                    answer = pool.submit(lambda: list(srv.client.completions.create(**long, stream=True)))
                else:
                    answer = pool.submit(srv.client.completions.create, **long)
                gate.wait(lambda g: g.held > held, "the request's first step")
                time.sleep(0.1)  # past its 0.05 s (time only moves forward: no race)
                gate.open()
                if streamed:
                    with pytest.raises(openai.APIError, match="request_timeout_s"):
                        answer.result()
                else:
                    with pytest.raises(openai.APIStatusError) as info:
                        answer.result()
                    assert info.value.status_code == 504 and "request_timeout_s" in info.value.body["message"]
        srv.backend.cfg.request_timeout_s = 60
        assert srv.client.completions.create(**short).usage.completion_tokens == 2
    finally:
        srv.stop()


@pytest.mark.e2e
def test_serve_cli_fails_fast_on_bad_config(router_file, tmp_path, capsys):
    assert load_config(ServeConfig, Path(__file__).parents[1] / "configs" / "serve.yaml").engine.max_batch_size == 8
    assert cli_serve.main(["--describe"]) == 0
    described = capsys.readouterr().out
    assert "queue_limit" in described and "engine.max_batch_size: int = 8" in described  # serve's own default
    assert cli_serve.main(["--router", str(router_file), "max_batch_size=4"]) == 2  # a key that moved names its new place
    assert capsys.readouterr().err == "serve: error: max_batch_size was renamed to engine.max_batch_size: use that key instead\n"
    assert cli_serve.main([]) == 2
    assert "needs a router" in capsys.readouterr().err
    assert cli_serve.main(["--router", str(tmp_path / "missing.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_serve.main(["--router", str(router_file), "max_batch=4"]) == 2
    assert "unknown key 'max_batch'" in capsys.readouterr().err
    assert cli_serve.main(["--role", "draft", "--router", str(router_file)]) == 2
    assert "--target HOST:PORT" in capsys.readouterr().err


@pytest.mark.integration
def test_serve_names_a_missing_draft_with_the_router_file(model_dirs, tmp_path, capsys, monkeypatch):
    """A draft folder that is gone, or a hub id that is not cached while offline: one error line
    naming the router file and the draft, before anything loads (a hub id once spent 54 s in
    transformers' retries)."""
    import huggingface_hub.constants

    gone = tmp_path / "runs" / "code-draft" / "best"
    router = tmp_path / "router.pt"
    Router.create({"code": str(gone)}, str(model_dirs["target"])).save(router)
    capsys.readouterr()  # the embedder's loading bar, when this test is the first to load it
    assert cli_serve.main(["--router", str(router)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(router) in err and "draft 'code'" in err and str(gone) in err and "does not exist" in err
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    # The minute of retries came from connections to the hub: offline, none may be attempted at all.
    connections = []

    def connect(sock, address):
        connections.append(address)
        raise OSError(f"this test allows no connection (to {address})")

    monkeypatch.setattr(socket.socket, "connect", connect)
    Router.create({"chat": "choral-tests/no-such-draft"}, str(model_dirs["target"])).save(router)
    assert cli_serve.main(["--router", str(router)]) == 2
    err = capsys.readouterr().err
    assert "draft 'chat'" in err and "choral-tests/no-such-draft" in err and "HF_HUB_OFFLINE" in err
    assert connections == []


@pytest.mark.e2e
def test_predicted_outputs_and_model_free_drafters_give_the_same_answer(live, reference):
    """OpenAI's ``prediction`` drafts from the client's expected text; ``ngram`` and ``suffix``
    are drafter names like any other. All share the one engine and give the target's answer."""
    [ref] = reference.generate([Request(_chat_ids(reference, CHAT), max_new_tokens=20)])
    before = live.metrics()
    out = live.client.chat.completions.create(model=live.model, messages=CHAT, max_tokens=20, temperature=0,
                                              prediction={"type": "content", "content": ref.text})  # fmt: skip
    choral = out.model_extra["choral"]
    assert out.choices[0].message.content == ref.text and choral["draft"] == "prediction"
    # The tiny tokenizer splits the re-encoded text differently in places, so not all of it is accepted.
    assert choral["acceptance_rate"] > 0.2 and choral["target_calls"] < out.usage.completion_tokens
    for name in ("ngram", "suffix", "prediction", "auto"):  # prediction named without one: it proposes nothing
        forced = live.client.chat.completions.create(model=live.model, messages=CHAT, max_tokens=20, temperature=0,
                                                     extra_body={"draft": name})  # fmt: skip
        assert forced.choices[0].message.content == ref.text and forced.model_extra["choral"]["draft"] == name
        shares = forced.model_extra["choral"]["drafter_shares"]
        assert abs(sum(shares.values()) - 1.0) < 1e-9 and (name == "auto" or set(shares) <= {name, "none"})
    after = live.metrics()
    steps = [v for (metric, labels), v in after.items() if metric == "choral_drafter_steps_total" and ("draft", "auto") in labels]
    assert sum(steps) >= 1  # auto's steps, by the drafter each verified
    drafts = ("choral_spec_decode_drafts_total", (("draft", "prediction"),))
    assert after[drafts] - before.get(drafts, 0.0) >= 1
    accepted = ("choral_accepted_tokens_total", (("draft", "prediction"),))
    assert after[accepted] - before.get(accepted, 0.0) >= choral["acceptance_rate"] * 1


@pytest.mark.e2e
def test_a_huge_prediction_is_cut_to_the_context_before_it_is_tokenized(live, reference, monkeypatch):
    """A prediction of 1.5 MB (under the body limit): only what max_len tokens can hold is
    tokenized, and the answer is still the target's."""
    tok = live.backend.models.tokenizer
    encoded, original = [], tok.encode

    def spy(text, *args, **kwargs):
        encoded.append(len(text))
        return original(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", spy)
    [ref] = reference.generate([Request(_chat_ids(reference, CHAT), max_new_tokens=8)])
    big = ref.text + "x = 1\n" * 250_000  # 1.5 MB
    out = live.client.chat.completions.create(model=live.model, messages=CHAT, max_tokens=8, temperature=0,
                                              prediction={"type": "content", "content": big})  # fmt: skip
    assert out.choices[0].message.content == ref.text
    cap = MAX_LEN * live.backend._longest_token()
    assert encoded and max(encoded) <= cap < len(big)


def test_forced_requests_skip_the_router(live, monkeypatch):
    """A request that names its draft is not embedded (that would only delay the next step), so
    it is served even while the router fails; a routed request then gets a clean 500."""
    calls = []

    def broken(texts, occupancy=1, prompt_tokens=None):
        calls.append(texts)
        raise RuntimeError("router down")

    monkeypatch.setattr(live.backend.scheduler.router, "choose_batch", broken)
    forced = live.client.completions.create(model=live.model, prompt="def f(x):", max_tokens=4, temperature=0,
                                            extra_body={"draft": "code"})  # fmt: skip
    assert forced.usage.completion_tokens == 4 and forced.model_extra["choral"]["draft"] == "code"
    assert calls == []
    with pytest.raises(openai.InternalServerError, match="routing failed: RuntimeError: router down"):
        live.client.completions.create(model=live.model, prompt="def f(x):", max_tokens=4, temperature=0)
    assert len(calls) == 1


@pytest.mark.integration
def test_cancelled_handler_aborts_its_ticket():
    """A non-streaming handler cancelled while it waits (server shutdown, or the ASGI server
    dropping the task) must free the request's slot, not leave it decoding for nobody."""
    import asyncio

    from serving.engine import Request
    from serving.server.scheduler import Ticket
    from serving.server.serve_config import ServeConfig

    class Scheduler:
        aborted: list = []

        def abort(self, ticket):
            self.aborted.append(ticket)

    class Http:
        async def receive(self):
            await asyncio.sleep(3600)  # the client never disconnects on its own

    async def run():
        server = EngineServer(ServeConfig())
        server.scheduler = Scheduler()
        ticket = Ticket(Request([1, 2, 3]), "hi", asyncio.get_running_loop())
        counted = []
        context = type("Context", (), {"count": lambda self, status: counted.append(status)})()
        task = asyncio.create_task(server._collect(Http(), ticket, context))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return server.scheduler.aborted, ticket

    aborted, ticket = asyncio.run(run())
    assert aborted == [ticket]


@pytest.mark.e2e
def test_api_key_guards_every_route_but_health_and_metrics(router_file, monkeypatch):
    monkeypatch.setenv("CHORAL_API_KEY", "s3cret")  # as vLLM's VLLM_API_KEY; api_key=... in the config wins
    srv = LiveServer([f"router={router_file}", f"engine.max_len={MAX_LEN}", "engine.max_batch_size=1", "engine.k=2",
                      "warmup=false"])  # fmt: skip
    try:
        deadline = time.time() + 120
        while srv.request("GET", "/health")[0] != 200:  # open without the key
            assert time.time() < deadline
            time.sleep(0.05)
        assert srv.request("GET", "/metrics")[0] == 200
        for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", b'{"model": "m", "prompt": "hi"}'),
                                   ("POST", "/v1/chat/completions", b"{}"), ("GET", "/docs", None), ("GET", "/openapi.json", None)]:
            status, text = srv.request(method, path, body)
            assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key", (path, status)
        assert srv.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        keyed = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        model = keyed.models.list().data[0].id
        assert "/" not in model  # a model id, not the target's folder
        assert keyed.completions.create(model=model, prompt="hi", max_tokens=2).choices[0].finish_reason
        with pytest.raises(openai.AuthenticationError):
            srv.client.completions.create(model=model, prompt="hi", max_tokens=2)  # api_key="test"
        assert srv.request("GET", "/docs", headers={"Authorization": "Bearer s3cret"})[0] == 404  # docs off by default
    finally:
        srv.stop()


# ---- issue 71: logits processors and logprobs ----------------------------------------------------


def stand_in_logprobs(live, monkeypatch) -> None:
    """Where the engine leaves a request's logprobs empty although it asked for them, its step
    outputs get stand-in entries (a function of the token id: the same for a streamed and a
    non-streamed answer of the same tokens), so the server's shapes and alignment are tested
    whatever the engine fills; where the engine fills them, its own values are tested."""
    engine, tickets = live.backend.models.engine, live.backend.scheduler._tickets
    step = engine.step

    def entry(token: int, n: int) -> TokenLogprob:
        lp = -0.25 - token % 5
        return TokenLogprob(token, lp, tuple([(token, lp)] + [((token + j) % 320, lp - j) for j in range(1, n)])[:n])

    def filled():
        outputs = step()
        for out in outputs:
            ticket = tickets.get(out.request_id)  # the scheduler thread runs this: its table is stable here
            n = ticket.request.params.logprobs if ticket is not None else None
            if n is None:
                continue
            if out.new_token_logprobs is None:
                out.new_token_logprobs = [entry(t, n) for t in out.new_token_ids]
            if out.finished is not None and out.finished.logprobs is None:
                out.finished.logprobs = [entry(t, n) for t in out.finished.token_ids]
        return outputs

    monkeypatch.setattr(engine, "step", filled)


@pytest.mark.e2e
def test_sampling_fields_reach_sampling_params_and_are_reported(live, monkeypatch):
    seen = []
    submit = live.backend.scheduler.submit
    monkeypatch.setattr(live.backend.scheduler, "submit", lambda ticket: seen.append(ticket.request.params) or submit(ticket))
    before = live.metrics()
    out = live.client.chat.completions.create(
        model=live.model, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
        logit_bias={"17": 2.5, "5": -100}, frequency_penalty=0.5, presence_penalty=-0.25,
        extra_body={"min_p": 0.05, "repetition_penalty": 1.1})  # fmt: skip
    params = seen[-1]
    assert params.logit_bias == ((5, -100.0), (17, 2.5)) and params.logprobs == 2
    assert (params.frequency_penalty, params.presence_penalty, params.min_p, params.repetition_penalty) == (0.5, -0.25, 0.05, 1.1)
    assert out.model_extra["choral"]["processors"] == list(params.processors) == [
        "logit_bias", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p"]  # fmt: skip
    plain = live.client.completions.create(model=live.model, prompt="def add(a, b):", max_tokens=2, temperature=0, logprobs=3)
    assert seen[-1].logprobs == 3 and seen[-1].processors == () and plain.model_extra["choral"]["processors"] == []
    after = live.metrics()
    for name in params.processors:
        key = ("choral_processor_requests_total", (("processor", name),))
        assert after[key] - before.get(key, 0.0) == 1


def _chat_entries(chunks) -> list:
    return [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]


@pytest.mark.e2e
def test_logprobs_shapes_parse_and_streamed_equal_non_streamed(live, monkeypatch):
    stand_in_logprobs(live, monkeypatch)
    kw = dict(model=live.model, max_tokens=12, temperature=0, extra_body={"draft": "code"})
    chat = live.client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=3, **kw)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and isinstance(e.bytes, list) for e in content)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy: the chosen token is the most likely
    chunks = list(live.client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=3, stream=True, **kw))
    assert [e.model_dump() for e in _chat_entries(chunks)] == [e.model_dump() for e in content]
    for c in chunks:  # each chunk carries the logprobs of the tokens whose text it carries
        if c.choices:
            tokens = (c.model_extra.get("choral") or {}).get("tokens", [])
            assert len(c.choices[0].logprobs.content if c.choices[0].logprobs else []) == len(tokens)
            assert [e.token for e in (c.choices[0].logprobs.content if tokens else [])] == [
                live.backend.models.tokenizer.decode([t["id"]]) for t in tokens]  # fmt: skip

    prompt = "The quick brown"
    comp = live.client.completions.create(prompt=prompt, logprobs=2, **kw)
    lp = comp.choices[0].logprobs
    n = comp.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(lp.tokens[i] in lp.top_logprobs[i] and len(lp.top_logprobs[i]) <= 3 for i in range(n))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(comp.choices[0].text)
    chunks = list(live.client.completions.create(prompt=prompt, logprobs=2, stream=True, **kw))
    joined = {k: [x for c in chunks if c.choices[0].logprobs for x in getattr(c.choices[0].logprobs, k)]
              for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}  # fmt: skip
    assert joined == {k: getattr(lp, k) for k in joined}
    for c in chunks:  # a chunk's offsets start where its text does
        if c.choices[0].logprobs:
            start = sum(len(d.choices[0].text) for d in chunks[: chunks.index(c)])
            assert c.choices[0].logprobs.text_offset[0] == start
    # Not asked for: null, streamed or not.
    assert live.client.completions.create(prompt=prompt, **kw).choices[0].logprobs is None
    assert all(c.choices[0].logprobs is None for c in live.client.completions.create(prompt=prompt, stream=True, **kw))


@pytest.mark.e2e
def test_logprobs_are_the_targets_log_softmax(live, model_dirs):
    """Needs the engine's logprobs (issue 71's engine side): without processors, each token's
    logprob and its alternatives are the target's log-softmax at that position, under
    speculation (a model drafter proposes, the target verifies), the EOS's entry included."""
    import torch
    from transformers import AutoModelForCausalLM

    out = live.client.completions.create(model=live.model, prompt="def add(a, b):", max_tokens=10, temperature=0,
                                         logprobs=5, stream=True, extra_body={"draft": "code"})  # fmt: skip
    chunks = list(out)
    ids = [t["id"] for c in chunks for t in c.model_extra["choral"]["tokens"]]
    lps = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert len(lps) == len(ids), "the engine returned no logprobs"
    target = AutoModelForCausalLM.from_pretrained(model_dirs["target"]).eval()
    prompt = model_tokens(live, "def add(a, b):")
    with torch.no_grad():
        logits = target(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    expected = logits.log_softmax(-1)  # [len(ids), V]
    got = torch.tensor(lps)
    assert torch.allclose(got, expected[torch.arange(len(ids)), torch.tensor(ids)], atol=1e-3)
    tops = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.top_logprobs]
    assert all(abs(max(t.values()) - expected[i].max().item()) < 1e-3 for i, t in enumerate(tops))


@pytest.mark.e2e
def test_logit_bias_bans_the_greedy_first_token_under_speculation(live):
    """Needs the engine's processors (issue 71's engine side): a bias of -100 on the target's
    greedy first token changes the first token, and the banned token appears nowhere in the answer
    though the drafter (which knows nothing of the bias) may propose it."""

    def token_ids(**extra) -> list[int]:
        chunks = live.client.completions.create(model=live.model, prompt="The quick brown", max_tokens=8, temperature=0,
                                                stream=True, extra_body={"draft": "code"}, **extra)  # fmt: skip
        return [t["id"] for c in chunks for t in c.model_extra["choral"]["tokens"]]

    first = token_ids()[0]
    assert first < len(live.backend.models.tokenizer)  # a token logit_bias may name
    banned = token_ids(logit_bias={str(first): -100})
    assert banned[0] != first and first not in banned


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"], "additionalProperties": False}  # fmt: skip


@pytest.mark.e2e
def test_json_schema_and_json_mode_answers_parse_streamed_and_not(live):
    """The official client's response_format: a strict json_schema answer follows the schema and
    ends with stop, streamed as non-streamed, under every drafter; json_object gives a JSON object."""
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": SCHEMA, "strict": True}}
    answers = set()
    for draft in ("code", "ngram", "suffix", "none"):
        kw = dict(model=live.model, messages=CHAT, max_tokens=64, temperature=0, response_format=fmt, extra_body={"draft": draft})
        out = live.client.chat.completions.create(**kw)
        value = json.loads(out.choices[0].message.content)
        assert set(value) == {"ok", "color"} and value["color"] in ("red", "green") and out.choices[0].finish_reason == "stop"
        assert out.model_extra["choral"]["processors"] == ["grammar"]
        streamed = "".join(c.choices[0].delta.content or "" for c in live.client.chat.completions.create(stream=True, **kw) if c.choices)
        assert streamed == out.choices[0].message.content
        answers.add(streamed)
    assert len(answers) == 1  # greedy: every drafter gives the constrained target's answer
    grammar = live.client.chat.completions.create(model=live.model, messages=CHAT, max_tokens=64, temperature=0,
                                                  response_format=fmt, extra_body={"draft": "grammar"})  # fmt: skip
    assert grammar.choices[0].message.content in answers and grammar.model_extra["choral"]["drafter_shares"].get("grammar")
    metrics = live.request("GET", "/metrics")[1]
    forced = [line for line in metrics.splitlines() if line.startswith("choral_grammar_forced_tokens_total")]
    assert forced and float(forced[0].split()[-1]) > 0 and 'drafter="grammar"' in metrics
    obj = live.client.chat.completions.create(model=live.model, messages=CHAT, max_tokens=48, temperature=0,
                                              response_format={"type": "json_object"})  # fmt: skip
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # a tiny random model may write one long string: cut at max_tokens, still JSON so far
        assert obj.choices[0].message.content.startswith("{")


def _fuzzed_schemas(n: int, seed: int = 0) -> list:
    """Schemas a client may send: valid ones, unsupported features, wrong types, huge ones, junk."""
    import random

    rng = random.Random(seed)
    leaves = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"enum": ["a", "b", 3]},
              {"type": "no-such"}, {"$ref": "#/$defs/missing"}, {"type": "string", "pattern": "["}, {"not": {}},
              {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1}, {"anyOf": []}, 5, "x", None]  # fmt: skip

    def node(depth):
        if depth > 2 or rng.random() < 0.4:
            return rng.choice(leaves)
        props = {f"k{i}": node(depth + 1) for i in range(rng.randint(0, 3))}
        return {"type": "object", "properties": props, "required": list(props)[: rng.randint(0, len(props))]}

    out = [node(0) for _ in range(n)]
    out += [{"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}, [], "schema", 7]
    return out


@pytest.mark.e2e
def test_fuzzed_schemas_are_answered_or_refused_never_a_500_and_neighbours_finish(live):
    """500 schemas a client may send (valid, unsupported, malformed, over the size cap) beside valid
    requests: each is answered (200) or refused by name (400 naming response_format), never a
    500, and the neighbours' answers are unchanged."""
    import concurrent.futures

    want = live.client.chat.completions.create(model=live.model, messages=CHAT, max_tokens=8, temperature=0).choices[0].message.content
    bodies = [{"model": live.model, "messages": CHAT, "max_tokens": 3, "temperature": 0,
               "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}}
              for schema in _fuzzed_schemas(496)]  # fmt: skip  (500 with the four edge cases)

    def neighbour():
        return live.client.chat.completions.create(model=live.model, messages=CHAT, max_tokens=8, temperature=0).choices[0].message.content

    def fuzz(body) -> tuple[int, str | None]:  # (status, the param a 400 names)
        try:
            live.client.chat.completions.create(**body)
        except openai.APIStatusError as e:
            return e.status_code, e.param
        return 200, None

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # a valid neighbour after every 50 fuzzed bodies
        fuzzed, neighbours = [], []
        for i, body in enumerate(bodies):
            fuzzed.append(pool.submit(fuzz, body))
            if i % 50 == 25:
                neighbours.append(pool.submit(neighbour))
        results = [f.result() for f in fuzzed]
        assert len(results) == 500 and len(neighbours) == 10 and all(n.result() == want for n in neighbours)
    assert {status for status, _ in results} <= {200, 400}, sorted({s for s, _ in results})
    assert all(param == "response_format" for status, param in results if status == 400)
    assert sum(status == 200 for status, _ in results) >= 10 and sum(status == 400 for status, _ in results) >= 10
