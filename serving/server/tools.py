"""Tool calling through the OpenAI API (``tools``, ``tool_choice``, ``parallel_tool_calls``), in the
target's own chat-template format, exact under speculation like every other request.

The format is the template's. A template that writes calls as ``<tool_call>`` JSON ``</tool_call>``
(Qwen2.5, Hermes: ``HERMES``) gets the request's tools rendered by the template itself, and its
answer parsed back into OpenAI ``tool_calls``. ``required`` and a named function are constrained by
a grammar (``serving.engine.grammar``): one call (or, with ``parallel_tool_calls``, several) of the
allowed functions, each call's arguments following the function's JSON schema, so they always
parse; the call tags are the tokenizer's own tokens where it has them (``<[151657]>``), as the
model writes them. ``auto`` is parsed from the model's own output; a call it opens and never closes
is not a call: the text stays content (with ``length`` when the answer ran out of tokens).

A template without a tool format (``NO_FORMAT``): the tools cannot be shown to the model, so a named
function constrains the answer to its arguments JSON, ``required`` to a JSON list of
``{"name", "arguments"}`` (as vLLM does), and ``auto`` is refused by name.

``finish_reason`` follows OpenAI: ``tool_calls`` when the answer called tools under ``auto`` or
``required``; ``stop`` under a named ``tool_choice``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import regex

from serving.engine.grammar import SEPARATORS, checked

HERMES, NO_FORMAT = "hermes", "none"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128


class ToolError(ValueError):
    """A tools request that cannot be served, naming the field (``param``) and the fix."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """A request's tools: ``functions`` name -> parameters schema, in the request's order."""

    functions: dict[str, dict]
    tools: list[dict]  # as the chat template takes them ({"type": "function", "function": {...}})
    choice: str  # "none", "auto", "required" or "named"
    named: str | None
    parallel: bool

    @property
    def constrained(self) -> bool:
        """Whether the answer must call (``required``, a named function): a grammar makes it."""
        return self.choice in ("required", "named")

    @property
    def allowed(self) -> list[str]:
        return [self.named] if self.named else list(self.functions)


def parse_tools(tools: Any, tool_choice: Any, parallel: Any) -> Tools | None:
    """The request's ``tools``/``tool_choice``/``parallel_tool_calls``, checked; None without tools."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError(f"tool_choice={_short(tool_choice)} needs tools: send the functions in tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"tools must be a list of at most {MAX_TOOLS} {{\"type\": \"function\", \"function\": {{...}}}} "
                        f"objects, got {_short(tools)}", "tools")  # fmt: skip
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": "
                            f"{{...}}}}}}, got {_short(tool)}", where)  # fmt: skip
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolError(f"{where}.function.name={_short(name)} must be 1-64 letters, digits, '_', '.' or '-'",
                            f"{where}.function.name")  # fmt: skip
        if name in functions:
            raise ToolError(f"{where}.function.name={name!r} is given twice: function names must be unique", f"{where}.function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters={_short(params)} must be a JSON schema object",
                            f"{where}.function.parameters")  # fmt: skip
        if "description" in fn and not isinstance(fn["description"], str):
            raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
        functions[name] = params
    named = None
    if tool_choice is None:
        choice = "auto"
    elif isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolError(f"tool_choice={tool_choice!r} must be one of {', '.join(map(repr, CHOICES))} or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")  # fmt: skip
        choice = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(tool_choice.get("function"), dict):
        named, choice = tool_choice["function"].get("name"), "named"
        if named not in functions:
            raise ToolError(f"tool_choice names the function {_short(named)}, which is not among tools "
                            f"({', '.join(functions)})", "tool_choice")  # fmt: skip
    else:
        raise ToolError(f"tool_choice={_short(tool_choice)} must be \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")  # fmt: skip
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls={_short(parallel)} must be true or false", "parallel_tool_calls")
    plain = [{"type": "function", "function": {k: v for k, v in t["function"].items() if k in ("name", "description", "parameters")}}
             for t in tools]  # fmt: skip
    return Tools(functions, plain, choice, named, parallel is not False)


def template_format(tokenizer: Any) -> str:
    """The chat template's tool-call format: ``HERMES`` where it writes ``<tool_call>`` tags."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return HERMES if isinstance(template, str) and OPEN in template and "tools" in template else NO_FORMAT


def chat_messages(messages: list[Any]) -> list[dict]:
    """OpenAI chat messages (``openai_api.ChatMessage``) as a chat template takes them: an assistant's ``tool_calls`` with their
    ``arguments`` as objects (the template writes them as JSON), a tool message's content and id."""
    out = []
    for i, m in enumerate(messages):
        entry: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.role == "assistant" and m.tool_calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments, i, j)}}
                                   for j, c in enumerate(m.tool_calls)]  # fmt: skip
        if m.role == "tool":
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


def _arguments(arguments: str, i: int, j: int) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError as e:
        raise ToolError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON ({e}); send the arguments as "
                        "a JSON object in a string", f"messages[{i}].tool_calls")  # fmt: skip


def _call_schema(tools: Tools) -> dict:
    """One call of an allowed function: {"name": that name, "arguments": its parameters}."""
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": tools.functions[n]},
              "required": ["name", "arguments"], "additionalProperties": False} for n in tools.allowed]  # fmt: skip
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tool_grammar(tools: Tools, fmt: str, tokenizer: Any) -> str | None:
    """The llguidance grammar the answer must follow (``required`` and named choices), or None."""
    import llguidance

    if not tools.constrained:
        return None
    if fmt == NO_FORMAT:
        from serving.engine.grammar import json_schema_grammar

        if tools.choice == "named":
            return json_schema_grammar(tools.functions[tools.named])
        many = {"type": "array", "items": _call_schema(tools), "minItems": 1, **({} if tools.parallel else {"maxItems": 1})}
        return json_schema_grammar(many)
    schema = json.dumps({**_call_schema(tools), "x-guidance": SEPARATORS})
    call = f'{_tag(tokenizer, OPEN)} "\\n" %json {schema} "\\n" {_tag(tokenizer, CLOSE)}'
    start = 'call ("\\n" call)*' if tools.parallel and tools.choice == "required" else "call"
    lark = f"%llguidance {{}}\nstart: {start}\ncall: {call}\n"
    return checked("the tools' grammar (their parameters' schemas)", lark, lambda: llguidance.grammar_from("lark", lark))


def _tag(tokenizer: Any, tag: str) -> str:
    """A call tag in the grammar: the tokenizer's own token where it has one (as the model writes
    it; llguidance would spell the text in ordinary tokens), else the text."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(tag)


def parse_calls(text: str, tools: Tools, fmt: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer. Hermes: each closed ``<tool_call>`` block whose JSON
    names a function of the request; failing those, calls written as JSON that ends the answer (a
    fenced ```json block, several, or the whole answer; models tuned for code answer so, as llama.cpp
    also reads them). The text before the first call is the content (None if blank, else as
    written: a stream has sent it). No format: the whole answer is the named function's arguments,
    or the required list. Without ``parallel_tool_calls`` only the first call counts."""
    if tools.choice == "none":
        return text, []
    if fmt == NO_FORMAT:
        if tools.choice == "auto":
            return text, []
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut at max_tokens: the text as it is
        pairs = [(tools.named, value)] if tools.choice == "named" else [(c.get("name"), c.get("arguments")) for c in value]
        return None, [_call(n, a) for n, a in pairs]
    calls, first = [], None
    for m in re.finditer(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), text, flags=re.S):
        found = _calls(m.group(1), tools)
        if found:
            calls += found
            first = m.start() if first is None else first
    if not calls:
        first, calls = _json_calls(text, tools)
    if not calls:
        return text, []
    content = text[:first]  # as written (a stream sent it so), None when blank
    return (content if content.strip() else None), calls if tools.parallel else calls[:1]


def _calls(body: str, tools: Tools) -> list[dict]:
    """The calls a JSON text holds: one ``{"name", "arguments"}`` of a request's function, or a list
    of them; [] when it is anything else."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return []
    values = value if isinstance(value, list) and value else [value]
    ok = all(isinstance(v, dict) and v.get("name") in tools.functions and isinstance(v.get("arguments", {}), dict)
             for v in values)  # fmt: skip
    return [_call(v["name"], v.get("arguments", {})) for v in values] if ok else []


_FENCE = re.compile(r"```(?:json|JSON)?[ \t]*\n(.*?)\n?[ \t]*```", flags=re.S)


def _json_calls(text: str, tools: Tools) -> tuple[int | None, list[dict]]:
    """(where the calls begin, the calls) when the answer ends with calls written as JSON: the whole
    answer, or fenced blocks with only blank text between them and after the last."""
    if text.strip()[:1] in ("{", "["):
        calls = _calls(text, tools)
        return (None, []) if not calls else (len(text) - len(text.lstrip()), calls)
    blocks = list(_FENCE.finditer(text))
    calls, first, end = [], None, len(text.rstrip())
    for m in reversed(blocks):  # the blocks that end the answer, from the last one back
        found = _calls(m.group(1), tools)
        if not found or m.end() != end or (m.start() > 0 and text[m.start() - 1] != "\n"):
            break
        calls, first, end = found + calls, m.start(), len(text[: m.start()].rstrip())
    return first, calls


def _call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}  # fmt: skip


def finish_reason(reason: str, tools: Tools | None, calls: list[dict]) -> str:
    """OpenAI's rule: ``tool_calls`` when the model called tools (auto, required), ``stop`` when the
    request named the function; otherwise the engine's reason."""
    if tools is None or not calls:
        return reason
    return "stop" if tools.choice == "named" else "tool_calls"


# How a call written as JSON begins (``_json_calls``): a fence at a line's start, or the answer's
# first character. A stream holds text back from such a start while it may still be a call.
_OPENS = (regex.compile(r"```(?:json|JSON)?[ \t]*\n\s*\[?\s*\{\s*\"name\"\s*:"), regex.compile(r"\s*\[?\s*\{\s*\"name\"\s*:"))


def may_open(text: str) -> int:
    """Where in ``text`` a call may have begun (``OPEN``, a prefix of it at the end, or the start of
    a call written as JSON that the text so far does not rule out); len(text) when none: a stream
    sends content up to there and holds the rest back."""
    at = text.find(OPEN)
    if at < 0:
        at = next((len(text) - n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if text.endswith(OPEN[:n])), len(text))
    if _OPENS[1].match(text, partial=True):
        return 0
    for m in re.finditer(r"(?:^|\n)(`)", text[:at]):
        if _OPENS[0].match(text, m.start(1), partial=True):
            return m.start(1)
    return at


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text):,} characters)"
