"""OpenAI's wire format: request models with their validation, error bodies, response objects.

Requests are parsed by hand (``parse_request``) rather than by FastAPI's signature magic so that
every problem becomes the OpenAI error shape that clients expect,

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

with the offending field in ``param``. Types are strict: a boolean is not a number, a string of
digits is not a number, and an integer of more digits than any field can hold is refused by the
field it was sent in (Python would otherwise raise on its 4,301st digit). OpenAI fields the server
does not implement are refused with a 400 naming the field unless they hold their no-op value
(``NOT_IMPLEMENTED``: ``functions``, ``suffix``, ...; ``tools`` where a backend lacks them), since silently dropping them
would change the answer or what the client reads; ``user``, ``metadata``, ``store`` and
``service_tier`` only label a request and are accepted and ignored, as are keys OpenAI does not
define. The logits processors (``logit_bias``, the penalties, vLLM's ``min_p`` and
``repetition_penalty``) and ``logprobs`` are implemented: checked here against OpenAI's and vLLM's
ranges, and mapped onto ``SamplingParams`` by ``sampling_fields``.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError, field_validator, model_validator

from serving.engine.sampling import INT64_MAX, MAX_LOGPROBS, SEED_RANGE  # the bounds the engine itself enforces


class APIError(Exception):
    """An error answered as OpenAI's JSON error object with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None,
                 code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _DEFAULT_TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def headers(self) -> dict[str, str] | None:
        """A 408 or 413 leaves part of the body unread: close the connection rather than let the
        client keep trickling into it (uvicorn would discard the bytes and keep the socket)."""
        return {"Connection": "close"} if self.status in (408, 413) else None


_DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    503: "service_unavailable",
    504: "timeout",
}


MAX_TOKENS_LIMIT = 2**31 - 1
MAX_INT_DIGITS = 40  # more than any field holds (a 64-bit seed has 20 digits), far under Python's 4,300


class OversizedInt:
    """A JSON integer of more than ``MAX_INT_DIGITS`` digits, kept unconverted so that the field
    that holds it refuses it by name (``int()`` of 4,301 digits raises, which was a 500)."""

    def __init__(self, digits: str) -> None:
        self.digits = len(digits.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits:,} digits>"


def _parse_int(text: str) -> int | OversizedInt:
    return int(text) if len(text) <= MAX_INT_DIGITS else OversizedInt(text)


MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit of the completions endpoint's logprobs (chat's top_logprobs: 20)
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's: a bias in [-100, 100]

# OpenAI request fields Choral does not implement -> the values that ask for nothing (accepted).
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "suffix": (None, ""),
}


def _check_text_parts(parts: list[dict[str, Any]], field: str) -> None:
    """Every text content part holds a string as its text (``str.join`` would fail on another)."""
    bad = next((p["text"] for p in parts if not isinstance(p.get("text", ""), str)), None)
    if bad is not None:
        raise ValueError(f"a text part of {field} holds {type(bad).__name__} {_short(bad)} as its text; send a string")


def _is_no_op(name: str, value: Any) -> bool:
    # type-exact: True == 1 and False == 0 in Python, but neither is a penalty of 0
    return any(type(value) is type(ok) and value == ok for ok in NOT_IMPLEMENTED[name])


def _encodable(value: Any, field: str) -> None:
    """Every string inside ``value`` must encode as UTF-8: JSON may carry a lone surrogate
    (``"\\ud800"``), which Python keeps in a str that no tokenizer can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{field} holds a lone surrogate ({value[e.start:e.end]!r} at character {e.start}), which is "
                             "not text; send valid UTF-8 (pair the surrogate or drop it)") from None  # fmt: skip
    elif isinstance(value, list):
        for item in value:
            _encodable(item, field)
    elif isinstance(value, dict):
        for item in value.values():
            _encodable(item, field)


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: ``{"type": "content", "content": "..."}`` (or content parts)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["content"]
    content: str | list[dict[str, Any]]

    @field_validator("content")
    @classmethod
    def _content(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        _encodable(v, "prediction.content")
        if isinstance(v, list):
            _check_text_parts([p for p in v if p.get("type") == "text"], "prediction.content")
        return v

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.get("text", "") for p in self.content if isinstance(p, dict) and p.get("type") == "text")


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    # Strict integers and booleans: pydantic's lax mode reads max_tokens=true as 1 and
    # stream="yes" as true, answers a client did not ask for.
    max_tokens: StrictInt | None = None
    temperature: StrictFloat = 1.0  # an int is a number; a bool or "0.5" is refused
    top_p: StrictFloat = 1.0
    top_k: StrictInt = 0
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: dict[str, StrictBool | None] | None = None
    # Logits processors (serving.engine.processors), applied to the target's logits at every
    # position a step verifies: exact under speculation whatever the drafter. None: off.
    logit_bias: dict[StrictStr, StrictFloat] | None = None  # token id (a string, as JSON keys are) -> bias
    frequency_penalty: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    min_p: StrictFloat | None = None  # vLLM's extension
    repetition_penalty: StrictFloat | None = None  # vLLM's extension
    # Not implemented (NOT_IMPLEMENTED), and refused when asked for: a client that sends tools
    # expects tool calls, one that sets a response format expects another answer; silence would
    # hand each a wrong one.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    # JSON mode and JSON schema (serving.engine.grammar): {"type": "text" | "json_object"}, or
    # {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}.
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    # check_fields=False: ``suffix`` is a field of CompletionRequest only, checked here all the same
    @field_validator(*NOT_IMPLEMENTED, check_fields=False)
    @classmethod
    def _unsupported(cls, v: Any, info) -> Any:
        if info.field_name in ((info.context or {}).get("implemented") or ()):
            return v  # the backend implements it (vLLM replicas: penalties, logit_bias, response_format)
        if not _is_no_op(info.field_name, v):
            allowed = " or ".join(json.dumps(x) for x in NOT_IMPLEMENTED[info.field_name])
            raise ValueError(f"{info.field_name}={_short(v)} is not supported by this server; omit it (or send {allowed})")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: Any, info) -> Any:
        if v is None or "response_format" in ((info.context or {}).get("implemented") or ()):
            return v
        kind = v.get("type") if isinstance(v, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format={_short(v)} must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
                             "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}")  # fmt: skip
        if kind == "json_schema":
            spec = v.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError(f"response_format.json_schema={_short(spec)} must be an object whose \"schema\" is a JSON "
                                 "schema object")  # fmt: skip
            if "name" in spec and not isinstance(spec["name"], str):
                raise ValueError(f"response_format.json_schema.name={_short(spec['name'])} must be a string")
        return v

    @property
    def json_schema(self) -> tuple[bool, dict | None]:
        """(whether the answer must be JSON, its schema: None for any JSON object)."""
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            return True, None
        if kind == "json_schema":
            return True, self.response_format["json_schema"].get("schema") or {}
        return False, None

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _penalty(cls, v: float | None, info) -> float | None:
        if v is not None and not -2 <= v <= 2:  # (NaN fails every comparison: refused too)
            raise ValueError(f"{info.field_name}={v} must be in [-2, 2] (0 = off)")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v: float | None) -> float | None:
        if v is not None and not 0 <= v <= 1:
            raise ValueError(f"min_p={v} must be in [0, 1] (0 = off)")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, v: float | None) -> float | None:
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise ValueError(f"repetition_penalty={v} must be a finite number > 0 (1 = off; above 1 discourages repeats)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            # No sign, space or fraction, and no leading zero ("05" and "5" would bias one token twice).
            if not (key.isascii() and key.isdigit() and (key == "0" or key[0] != "0")):
                raise ValueError(f"logit_bias key {_short(key)} is not a token id: keys are token ids written in "
                                 "decimal, e.g. {\"1234\": -100}")  # fmt: skip
            if len(key) > MAX_INT_DIGITS:  # int() of a longer key is slow, or raises past 4,300 digits
                raise ValueError(f"logit_bias key {_short(key)} is beyond any vocabulary")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias[{key!r}]={bias} must be in [-100, 100] (-100 bans the token, 100 "
                                 "all but forces it)")  # fmt: skip
        return v

    draft: StrictStr | None = None  # Choral: force a drafter name, or "none" for the target alone
    prediction: Prediction | None = None  # the text the client expects the answer to repeat
    # Choral: "exact" (the target's own output) or "threshold" (opt-in, lossy: a draft token is also
    # accepted when the target's probability of it is at least verification_threshold). None: the server's.
    verification: Literal["exact", "threshold"] | None = None
    verification_threshold: StrictFloat | None = None

    @field_validator("verification_threshold")
    @classmethod
    def _verification_threshold(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 1:
            raise ValueError(f"verification_threshold={v} must be in (0, 1] (0.1 is the usual)")
        return v

    @field_validator("model", "draft")
    @classmethod
    def _text(cls, v: str | None, info) -> str | None:
        _encodable(v, info.field_name)
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"temperature={v} must be a finite number >= 0 (0 = greedy)")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        lo, hi = SEED_RANGE
        if v is not None and not lo <= v <= hi:
            raise ValueError(f"seed={v} is outside [{lo}, {hi}] (a 64-bit seed); send a smaller one")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"top_p={v} must be in (0, 1] (1 = off)")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if not 0 <= v <= INT64_MAX:
            raise ValueError(f"top_k={v} must be in [0, {INT64_MAX}] (0 = off; any k above the vocabulary keeps every token)")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= MAX_TOKENS_LIMIT:
            raise ValueError(f"max_tokens={v} must be in [1, {MAX_TOKENS_LIMIT}]")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"n={v}: this server returns one choice per request; send n=1 (or omit it)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > 4 or any(not s for s in stops)):
            raise ValueError(f"stop={v!r} must be up to 4 non-empty strings")
        _encodable(stops, "stop")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: dict[str, bool] | None, info) -> dict[str, bool] | None:
        if v is not None and not info.data.get("stream"):  # stream is declared (so validated) first
            raise ValueError("stream_options is only allowed when stream is true; drop it or send stream=true")
        return v

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    @property
    def logprob_count(self) -> int | None:
        """``SamplingParams.logprobs``: None (no logprobs), or the alternatives per token."""
        return None

    def sampling_fields(self) -> dict[str, Any]:
        """The request's logits processors and logprobs as ``SamplingParams`` keyword arguments
        (``logit_bias`` as sorted (token id, bias) pairs); fields not sent keep their defaults."""
        out: dict[str, Any] = {"logprobs": self.logprob_count}
        if self.logit_bias:
            out["logit_bias"] = tuple(sorted((int(k), float(b)) for k, b in self.logit_bias.items()))
        for name in ("frequency_penalty", "presence_penalty", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                out[name] = float(getattr(self, name))
        return out


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt]
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: Any = None  # text after the completion (insertion): not implemented (NOT_IMPLEMENTED)
    logprobs: StrictInt | None = None  # the chosen token's logprob and the N most likely tokens' (0..5)
    top_logprobs: Any = None  # chat's field: refused here unless null

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_COMPLETION_LOGPROBS:
            raise ValueError(f"logprobs={v} must be in [0, {MAX_COMPLETION_LOGPROBS}] (the most likely tokens returned "
                             "with each token's own logprob; chat takes up to 20 as top_logprobs)")  # fmt: skip
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError(f"top_logprobs={_short(v)} is a chat field: the completions endpoint takes logprobs=N "
                             f"(0..{MAX_COMPLETION_LOGPROBS}) instead")  # fmt: skip
        return v

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[str] | list[int]) -> str | list[int]:
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            if len(v) != 1:
                raise ValueError(f"a list of {len(v)} prompts: send one prompt per request")
            v = v[0]
        if not v:
            raise ValueError("prompt is empty")
        if isinstance(v, list) and any(not 0 <= i <= INT64_MAX for i in v):
            raise ValueError("prompt token ids must be in [0, vocabulary size)")
        _encodable(v, "prompt")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo=true is not supported (the prompt's text and logprobs are not returned); omit it")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError(f"best_of={v} is not supported; send 1 (or omit it)")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (multi-turn tool use)
    tool_call_id: StrictStr | None = None  # a tool message: the call it answers

    @field_validator("content")
    @classmethod
    def _content(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        _encodable(v, "the content of one of messages")
        return v

    def text(self) -> str:
        """The content as one string; a list of parts keeps its text parts."""
        if isinstance(self.content, list):
            if any(p.get("type") != "text" for p in self.content):
                raise ValueError("only text content parts are supported")
            _check_text_parts(self.content, "messages")
            return "".join(p.get("text", "") for p in self.content)
        return self.content or ""


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


ChatMessage.model_rebuild()


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    parallel_tool_calls: StrictBool | None = None  # with tools: several calls in one answer (default true)
    max_completion_tokens: StrictInt | None = None  # newer clients' name for max_tokens
    logprobs: StrictBool | None = None  # each token's logprob in choices[0].logprobs.content
    top_logprobs: StrictInt | None = None  # with logprobs=true: the N most likely tokens too (0..20)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs={v} must be in [0, {MAX_LOGPROBS}] (the most likely tokens returned with "
                             "each token)")  # fmt: skip
        if v and not info.data.get("logprobs"):  # logprobs is declared (so validated) first
            raise ValueError(f"top_logprobs={v} needs logprobs=true: send both (or drop top_logprobs)")
        return v

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages is empty: give at least one message")
        for i, m in enumerate(v):
            m.text()
            if m.role == "tool" and not m.tool_call_id:
                raise ValueError(f"messages[{i}] is a tool message without tool_call_id: send the id of the call it "
                                 "answers (the assistant's tool_calls[].id)")  # fmt: skip
            if m.tool_calls and m.role != "assistant":
                raise ValueError(f"messages[{i}] has tool_calls but role {m.role!r}: only an assistant's message calls tools")
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"max_completion_tokens={v} must be >= 1")
        return v

    @model_validator(mode="after")
    def _alias(self) -> "ChatCompletionRequest":
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


def sampling_error(error: ValueError) -> APIError:
    """A 400 of ``SamplingParams``' own check, naming the field its message starts with."""
    message = str(error)
    name = message.split("=")[0].split(" ")[0]
    return APIError(400, message, param=name if name in _Sampling.model_fields or name == "logprobs" else None)


def parse_json(raw: bytes) -> Any:
    """JSON with integers bounded (``OversizedInt``), or an ``APIError``."""
    try:
        return json.loads(raw, parse_int=_parse_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply to parse; no field of this API nests more than a few "
                       "levels", code="invalid_json") from None  # fmt: skip


def parse_request(raw: bytes, cls: type[_Sampling], implemented: frozenset[str] = frozenset()) -> _Sampling:
    """The request body as ``cls``, or an ``APIError`` naming the bad field. ``implemented``:
    fields of ``NOT_IMPLEMENTED`` that the backend does implement (accepted with any value)."""
    return validate_request(parse_json(raw), cls, implemented)


def validate_request(data: Any, cls: type[_Sampling], implemented: frozenset[str] = frozenset()) -> _Sampling:
    """``parse_request`` for a body already parsed by ``parse_json`` (a front that forwards the
    body parses it once)."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    try:
        return cls.model_validate(data, context={"implemented": implemented})
    except ValidationError as e:
        err = e.errors()[0]
        param = _param_name(err["loc"])
        if err["type"] == "missing":
            raise APIError(400, f"missing required field {param!r}", param=param, code="missing_required_parameter") from None
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] != "value_error":  # pydantic's own type messages do not say which field
            message = f"{param}: {message} (got {_short(err.get('input'))})"
        raise APIError(400, message, param=param) from None


def _short(value: Any, limit: int = 80) -> str:
    """A value for an error message: its repr, cut (a 2 MB string is not echoed back)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text):,} characters)"


def _param_name(loc: tuple) -> str | None:
    """("messages", 0, "role") -> "messages[0].role"; a union's member names (("prompt", "str"))
    are pydantic's, not the client's, and are dropped."""
    name = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            name += f"[{part}]"
        elif i == 0 or loc[0] == "messages" and i == 2:
            name += f".{part}" if name else part
    return name or None


# ---- responses -------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def completion_body(rid: str, model: str, text: str | None, finish_reason: str, usage: dict, choral: dict, chat: bool,
                    logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:  # fmt: skip
    """A whole response; ``logprobs``: the choice's (``serving.server.logprobs``), None when not asked
    for; ``tool_calls``: the answer's calls (``serving.server.tools``)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        if tool_calls:
            choice["message"]["tool_calls"] = tool_calls
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage, "choral": choral}  # fmt: skip


def chunk_body(rid: str, model: str, created: int, chat: bool, *, text: str | None = None, role: bool = False,
               finish_reason: str | None = None, choral: dict | None = None, usage: dict | None = None,
               logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:  # fmt: skip
    """One streamed chunk; ``text=None`` with ``usage`` set gives the final usage-only chunk;
    ``logprobs``: those of the tokens whose text the chunk carries."""
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created, "model": model, "choices": []}  # fmt: skip
    if text is not None or role or finish_reason is not None:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:  # each call whole, in one delta (OpenAI's stream may split the arguments; one piece is valid)
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        body["choices"] = [choice]
    if choral is not None:
        body["choral"] = choral
    if usage is not None:
        body["usage"] = usage
    return body


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
