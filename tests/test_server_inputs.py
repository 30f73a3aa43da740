"""What the server does with inputs that arrive badly, without a model: a body that trickles in,
a client that leaves mid-upload, an integer too long to parse, a public address without a key."""

import asyncio
import logging

import pytest
from starlette.requests import ClientDisconnect

from serving.server import cli_serve
from serving.server.http import read_body
from serving.server.openai_api import APIError, CompletionRequest, parse_request
from serving.server.serve_config import ServeConfig

pytestmark = pytest.mark.unit


class FakeRequest:
    """A starlette request as read_body sees it: ``stream()`` yields ``chunks``, then does what
    ``then`` says: "end", "hang" (a client that never sends the rest) or "leave" (it disconnects)."""

    method, url = "POST", type("U", (), {"path": "/v1/completions"})()

    def __init__(self, chunks: list[bytes], then: str) -> None:
        self.chunks, self.then = chunks, then

    async def stream(self):
        for chunk in self.chunks:
            yield chunk
        if self.then == "hang":
            await asyncio.Event().wait()  # nothing ever sets it: only the deadline ends this
        if self.then == "leave":
            raise ClientDisconnect()


def test_a_whole_body_is_read():
    assert asyncio.run(read_body(FakeRequest([b'{"a":', b" 1}"], "end"), 1024, 5.0)) == b'{"a": 1}'


def test_a_trickling_body_is_cut_off_at_the_deadline_with_408():
    with pytest.raises(APIError) as info:
        asyncio.run(read_body(FakeRequest([b'{"model": '], "hang"), 1024, 0.05))
    assert info.value.status == 408 and "body_timeout_s=0.05" in info.value.message and "10 bytes" in info.value.message


def test_a_client_gone_mid_upload_is_499_with_one_info_line(caplog):
    with caplog.at_level(logging.INFO, logger="choral.server"), pytest.raises(APIError) as info:
        asyncio.run(read_body(FakeRequest([b"x" * 7], "leave"), 1024, 5.0))
    assert info.value.status == 499 and info.value.code == "client_closed_request"
    [record] = caplog.records
    assert record.levelname == "INFO" and "after 7 bytes" in record.getMessage() and record.exc_info is None


def test_an_oversized_body_is_still_413():
    with pytest.raises(APIError) as info:
        asyncio.run(read_body(FakeRequest([b"x" * 2000], "end"), 1024, 5.0))
    assert info.value.status == 413


@pytest.mark.parametrize("field,raw", [
    ("seed", b'"seed": ' + b"9" * 4301),
    ("max_tokens", b'"max_tokens": -' + b"1" * 5000),
    ("prompt", b'"prompt": [' + b"3" * 4400 + b"]"),
])  # fmt: skip
def test_an_integer_too_long_for_python_is_a_400_naming_its_field(field, raw):
    body = b'{"model": "m", "prompt": "x", ' + raw + b"}" if field != "prompt" else b'{"model": "m", ' + raw + b"}"
    with pytest.raises(APIError) as info:
        parse_request(body, CompletionRequest)
    assert info.value.status == 400 and info.value.param == field
    assert "digits" in info.value.message and len(info.value.message) < 300  # the number is not echoed back


def test_an_unknown_key_holding_a_huge_integer_is_ignored_like_any_unknown_key():
    body = parse_request(b'{"model": "m", "prompt": "x", "x_unknown": ' + b"9" * 5000 + b"}", CompletionRequest)
    assert body.prompt == "x"


def test_body_timeout_must_be_positive():
    with pytest.raises(ValueError, match="body_timeout_s=0"):
        ServeConfig(body_timeout_s=0)


@pytest.mark.parametrize("host,key,warns", [("0.0.0.0", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False)])
def test_serving_beyond_loopback_without_an_api_key_warns(tmp_path, caplog, monkeypatch, host, key, warns):
    monkeypatch.delenv("CHORAL_API_KEY", raising=False)
    router = tmp_path / "router.pt"
    router.write_bytes(b"")
    cfg = ServeConfig(router=str(router), host=host, api_key=key)
    with caplog.at_level(logging.WARNING, logger=cli_serve.log.name):
        try:
            cli_serve._check(cfg)
        except cli_serve.ConfigError:
            pass  # the empty router file: the warning comes before the router is read
    assert any("without an API key" in r.getMessage() for r in caplog.records) == warns


@pytest.mark.parametrize("engine", [{"cuda_graphs": True}, {"compile_backend": "inductor", "cpu_kernels": False}])
def test_the_target_role_refuses_settings_it_would_otherwise_ignore(engine):
    """serve --role target once unpacked the settings into eight keywords and silently dropped
    the rest; it now loads through the engine's own loader, and what it cannot honour is refused."""
    from serving.engine.engine_settings import EngineSettings

    cfg = ServeConfig(role="target", target_model="some/target", engine=EngineSettings(**engine))
    with pytest.raises(cli_serve.ConfigError, match="role=target") as info:
        cli_serve._check(cfg)
    assert next(iter(engine)) in str(info.value)


def test_one_session_timeout_default_everywhere():
    import inspect

    from serving.distributed import SESSION_TIMEOUT_S
    from serving.distributed.verify_service import VerifyServer, VerifyService, serve_target

    assert ServeConfig().session_timeout_s == SESSION_TIMEOUT_S
    for fn in (VerifyServer.__init__, VerifyService.__init__, serve_target):
        assert inspect.signature(fn).parameters["session_timeout_s"].default == SESSION_TIMEOUT_S


def test_grpc_node_tokens_exclude_a_shared_token_and_caps_are_positive():
    from serving.server.serve_config import GrpcSettings

    with pytest.raises(ValueError, match="one shared token or per-node tokens"):
        GrpcSettings(token="t", node_tokens={"a": "x"})
    with pytest.raises(ValueError, match="max_sessions_per_node=0"):
        GrpcSettings(max_sessions_per_node=0)
    assert GrpcSettings(node_tokens={"a": "x", "b": "y"}, max_sessions_per_node=3).node_tokens == {"a": "x", "b": "y"}


def test_the_vllm_front_forwards_fields_vllm_implements():
    """response_format is checked by Choral's own engine (OpenAI's shapes) and forwarded as it is by
    the vLLM front (its replicas check it); the logits processors and logprobs are accepted by both,
    within the same ranges; tools stay refused on both."""
    from serving.server.vllm_backend import VLLM_IMPLEMENTS

    raw = b'{"model": "m", "prompt": "x", "frequency_penalty": 0.5, "logit_bias": {"5": 3}, "response_format": {"type": "json_object"}}'
    assert parse_request(raw, CompletionRequest).json_schema == (True, None)
    with pytest.raises(APIError, match="response_format"):
        parse_request(raw.replace(b"json_object", b"xml"), CompletionRequest)
    assert parse_request(raw.replace(b"json_object", b"xml"), CompletionRequest, implemented=VLLM_IMPLEMENTS)
    body = parse_request(raw, CompletionRequest, implemented=VLLM_IMPLEMENTS)
    assert body.frequency_penalty == 0.5 and body.logit_bias == {"5": 3}
    processors = b'{"model": "m", "prompt": "x", "logprobs": 2, "logit_bias": {"5": 3}, "min_p": 0.1, "repetition_penalty": 1.1}'
    for implemented in (frozenset(), VLLM_IMPLEMENTS):
        assert parse_request(processors, CompletionRequest, implemented=implemented).sampling_fields()["min_p"] == 0.1
    with pytest.raises(APIError, match="min_p"):
        parse_request(b'{"model": "m", "prompt": "x", "min_p": 2}', CompletionRequest, implemented=VLLM_IMPLEMENTS)
    with pytest.raises(APIError, match="tools"):
        parse_request(b'{"model": "m", "prompt": "x", "tools": [{"type": "function"}]}', CompletionRequest, implemented=VLLM_IMPLEMENTS)


def test_a_408_or_413_closes_the_connection_and_other_errors_keep_it():
    assert APIError(408, "slow").headers == {"Connection": "close"} == APIError(413, "big").headers
    assert APIError(400, "bad").headers is None


def test_a_prediction_text_part_must_be_text_and_stream_options_may_hold_null():
    from serving.server.openai_api import ChatCompletionRequest

    with pytest.raises(APIError) as info:
        parse_request(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                      b'"prediction": {"type": "content", "content": [{"type": "text", "text": 5}]}}', ChatCompletionRequest)  # fmt: skip
    assert info.value.status == 400 and "prediction" in info.value.message
    body = parse_request(b'{"model": "m", "prompt": "x", "stream": true, "stream_options": {"include_usage": null}}', CompletionRequest)
    assert body.include_usage is False


@pytest.mark.parametrize("grpc_kwargs,message", [
    ({"max_sessions_per_node": 2}, "needs grpc.node_tokens"),
    ({"node_tokens": {}}, "at least one node"),
    ({"node_tokens": {"a": ""}}, "non-empty"),
    ({"node_tokens": {"a": "x", "b": "x"}}, "its own"),
])  # fmt: skip
def test_bad_node_token_settings_are_refused(grpc_kwargs, message):
    from serving.server.serve_config import GrpcSettings

    with pytest.raises(ValueError, match=message):
        GrpcSettings(**grpc_kwargs)
