"""Tool calling through the OpenAI API (issue 73), exact under speculation.

Tier 1: the request's tools checked field by field; answers parsed into tool_calls (closed calls of
known functions only); the grammar of a required or named choice accepts the calls the schemas
allow and nothing else. Tier 3 (e2e): the official ``openai`` client against ``serve`` on the tiny
pair, once with a Hermes tool template (Qwen2.5's format) and once with a template without one:
named, required and auto choices, streamed and not, parallel calls, a second turn with the tool's
result; every drafter gives the target alone's answer with the same tools.
"""

from __future__ import annotations

import json
import random

import openai
import pytest

from serving.server.tools import (HERMES, NO_FORMAT, ToolError, finish_reason, may_open, parse_calls, parse_tools,
                                  template_format, tool_grammar)  # fmt: skip

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, TIME]
# A Qwen2.5-style template: the tools in the system turn, calls in <tool_call> tags, results in <tool_response>.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call a function as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
DRAFTERS = ["none", "draft", "ngram", "suffix", "auto", "grammar"]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


# ---- tier 1 ---------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("tools, choice, parallel, param", [
    ("x", None, None, "tools"),
    ([{"type": "function"}], None, None, "tools[0]"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, None, "tools[0].function.parameters"),
    (TOOLS, "sometimes", None, "tool_choice"),
    (TOOLS, named("nope"), None, "tool_choice"),
    (TOOLS, {"type": "function"}, None, "tool_choice"),
    (None, "required", None, "tool_choice"),
    (TOOLS, "auto", "yes", "parallel_tool_calls"),
])  # fmt: skip
def test_bad_tools_are_named(tools, choice, parallel, param):
    with pytest.raises(ToolError) as e:
        parse_tools(tools, choice, parallel)
    assert e.value.param == param, str(e.value)


@pytest.mark.unit
def test_calls_are_parsed_from_closed_tags_of_known_functions():
    tools = parse_tools(TOOLS, "auto", None)
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')  # fmt: skip
    content, calls = parse_calls(text, tools, HERMES)
    assert content == "Let me check.\n" and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 2} and calls[0]["id"].startswith("call_")
    assert finish_reason("stop", tools, calls) == "tool_calls"
    assert finish_reason("stop", parse_tools(TOOLS, named("get_time"), None), calls) == "stop"  # OpenAI: a named choice stops
    unclosed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'
    assert parse_calls(unclosed, tools, HERMES) == (unclosed, []) and finish_reason("length", tools, []) == "length"
    never_closed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'  # EOS before the tag
    assert parse_calls(never_closed, tools, HERMES) == (never_closed, [])
    unknown = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert parse_calls(unknown, tools, HERMES) == (unknown, [])
    assert may_open("Sure <tool") == 5 and may_open("Sure") == 4 and may_open("a<tool_call>{") == 1


@pytest.mark.unit
def test_calls_written_as_json_that_end_the_answer_are_calls():
    # Qwen2.5-Coder answers auto in a ```json fence, not in tags; llama.cpp reads these too.
    tools = parse_tools(TOOLS, "auto", None)
    call = '{\n  "name": "get_weather",\n  "arguments": {"city": "Oslo", "days": 2}\n}'
    fenced = f"```json\n{call}\n```"
    for text, content in [(fenced, None), (f"Checking.\n{fenced}\n", "Checking.\n"), (call, None),
                          (f"{fenced}\n```\n" + '[{"name": "get_time", "arguments": {"zone": "UTC"}}]\n```', None)]:
        got, calls = parse_calls(text, tools, HERMES)
        assert got == content and calls and calls[0]["function"]["name"] == "get_weather", text
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    assert len(parse_calls(f"{fenced}\n{fenced}", tools, HERMES)[1]) == 2
    assert len(parse_calls(f"{fenced}\n{fenced}", parse_tools(TOOLS, "auto", False), HERMES)[1]) == 1  # not parallel: one
    for text in [f"{fenced}\nThat is how you would call it.", f"Example: {fenced}",  # not the answer's end, not a line's start
                 fenced.replace("get_weather", "rm_rf"), "```python\nprint(1)\n```", '{"name": "get_weather"']:
        assert parse_calls(text, tools, HERMES) == (text, []), text


@pytest.mark.unit
def test_a_stream_holds_back_exactly_what_may_still_be_a_call():
    call = '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'
    for before in ["", "Sure.\n"]:
        text = before + call
        for n in range(len(text) + 1):  # every prefix a stream may have seen: the call's part is held
            assert may_open(text[:n]) == min(n, len(before)), (text[:n], may_open(text[:n]))
    code = "Here:\n```python\nprint('hi')\n```\nDone."
    assert may_open(code) == len(code) and may_open("Here:\n```") == 6  # a code fence is held only until it shows its language
    assert may_open(code[:-5]) == len(code) - 9  # a closing fence: another block, a call, may follow
    assert may_open("It is 4.") == 8 and may_open('{"nam') == 0 and may_open('{"a": 1}') == 8


@pytest.mark.unit
@pytest.mark.parametrize("fmt", [HERMES, NO_FORMAT])
def test_a_required_choices_grammar_admits_the_schemas_calls_only(tokenizer, fmt):
    from serving.engine.grammar import grammars_for

    g = grammars_for(tokenizer, 384)

    def admits(choice, text, parallel=None):
        m = g.matcher(tool_grammar(parse_tools(TOOLS, choice, parallel), fmt, tokenizer))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    def call(name, args):
        body = json.dumps({"name": name, "arguments": args})
        return f"<tool_call>\n{body}\n</tool_call>" if fmt == HERMES else body

    one, two = call("get_weather", {"city": "Lima", "days": 3}), call("get_time", {"zone": "CET"})
    if fmt == HERMES:
        assert admits("required", one) and admits("required", f"{one}\n{two}") and not admits("required", f"{one}\n{two}", False)
        assert admits(named("get_time"), two) and not admits(named("get_time"), one)
    else:
        assert admits("required", f"[{one}, {two}]") and not admits("required", f"[{one}, {two}]", False)
        assert admits(named("get_time"), json.dumps({"zone": "CET"}))
    assert not admits("required", call("get_weather", {"city": "Rome", "days": 3}))  # not in the enum
    assert not admits("required", call("get_weather", {"city": "Lima"}))  # a required argument missing


@pytest.mark.unit
def test_the_call_tags_are_the_tokenizers_own_tokens_where_it_has_them(tokenizer):
    import copy

    tagged = copy.deepcopy(tokenizer)
    tagged.add_tokens(["<tool_call>", "</tool_call>"])
    grammar = tool_grammar(parse_tools(TOOLS, "required", None), HERMES, tagged)
    assert f"<[{len(tokenizer)}]>" in grammar and f"<[{len(tokenizer) + 1}]>" in grammar
    assert '"<tool_call>"' in tool_grammar(parse_tools(TOOLS, "required", None), HERMES, tokenizer)


# ---- tier 3: the openai client against serve -------------------------------------------------


@pytest.fixture(scope="module", params=[HERMES, NO_FORMAT])
def served(request, model_dirs, tmp_path_factory):
    """serve on the tiny pair; the tokenizer's template with Qwen's tool format, or without one."""
    import shutil

    from routing.router import Router
    from serving.engine.models import load_tokenizer
    from tests.test_server import LiveServer

    root = tmp_path_factory.mktemp(f"tools-{request.param}")
    target = root / "target"
    shutil.copytree(model_dirs["target"], target)
    config = json.loads((target / "config.json").read_text())  # room for the tools the template writes (rotary: any length)
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    if request.param == HERMES:
        tok = load_tokenizer(str(target))
        tok.chat_template = HERMES_TEMPLATE
        tok.save_pretrained(target)
    router = root / "router.pt"
    Router.create({"draft": str(model_dirs["draft"])}, str(target)).save(router)
    srv = LiveServer([f"router={router}", "engine.max_len=1024", "engine.max_batch_size=4", "engine.k=4"])
    srv.wait_ready()
    srv.format = request.param
    yield srv
    srv.stop()


def ask(srv, draft: str, messages=CHAT, stream: bool = False, max_tokens: int = 96, **kw):
    body = dict(model=srv.model, messages=messages, max_tokens=max_tokens, temperature=0, tools=TOOLS, extra_body={"draft": draft}, **kw)
    if not stream:
        choice = srv.client.chat.completions.create(**body).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", [], None
    for chunk in srv.client.chat.completions.create(stream=True, **body):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += [(c.function.name, c.function.arguments) for c in delta.tool_calls or []]
        reason = chunk.choices[0].finish_reason or reason
    return content or None, calls, reason


@pytest.mark.e2e
@pytest.mark.parametrize("choice", ["required", "named", "parallel"])
def test_constrained_choices_call_with_arguments_that_follow_the_schema(served, choice):
    """required and named choices: every drafter's answer is the target alone's, streamed equals
    non-streamed, the arguments parse and follow the function's schema, finish_reason by OpenAI's rule."""
    kw = {"tool_choice": named("get_weather") if choice == "named" else "required",
          "parallel_tool_calls": choice == "parallel"}  # fmt: skip
    want = ask(served, "none", **kw)
    for draft in DRAFTERS:
        assert ask(served, draft, **kw) == want, draft
        assert ask(served, draft, stream=True, **kw) == want, draft
    content, calls, reason = want
    assert content is None and calls and (choice == "parallel" or len(calls) == 1)
    assert reason == ("stop" if choice == "named" else "tool_calls")
    for name, arguments in calls:
        args = json.loads(arguments)
        if name == "get_weather":
            assert args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7
        else:
            assert name == "get_time" and args["zone"] in ("UTC", "CET")
        assert choice != "named" or name == "get_weather"


@pytest.mark.e2e
def test_auto_is_the_models_own_answer_or_refused_without_a_tool_format(served):
    if served.format == NO_FORMAT:
        with pytest.raises(openai.BadRequestError) as e:
            ask(served, "none", tool_choice="auto")
        assert e.value.param == "tool_choice"
        return
    want = ask(served, "none", tool_choice="auto", max_tokens=32)
    for draft in DRAFTERS:
        assert ask(served, draft, tool_choice="auto", max_tokens=32) == want == ask(served, draft, stream=True, tool_choice="auto",
                                                                               max_tokens=32), draft  # fmt: skip
    assert ask(served, "none", tool_choice="none")[1] == []  # none: never a call


@pytest.mark.e2e
def test_a_second_turn_with_the_tools_result_completes(served):
    _, calls, _ = ask(served, "none", tool_choice="required")
    name, arguments = calls[0]
    turn = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]  # fmt: skip
    want = ask(served, "none", messages=turn, tool_choice="none", max_tokens=24)
    assert want[2] in ("stop", "length") and want[1] == []
    for draft in DRAFTERS:
        assert ask(served, draft, messages=turn, tool_choice="none", max_tokens=24) == want, draft


def fuzzed_tool_bodies(n: int, model: str, seed: int = 0) -> list[dict]:
    """Tool requests a client may send: bad schemas, unknown names, tool messages without ids, junk."""
    rng = random.Random(seed)
    leaves = [{"type": "string"}, {"type": "integer"}, {"enum": ["a", 1]}, {"type": "no-such"}, {"$ref": "#/nowhere"},
              {"type": "string", "pattern": "["}, 5, None, "x", [], {"anyOf": []}]  # fmt: skip
    names = ["f", "g", "bad name", "", 7, None, "x" * 80]
    out = []
    for _ in range(n):
        fns = [{"type": rng.choice(["function", "function", "tool"]),
                "function": {"name": rng.choice(names), "parameters": rng.choice([
                    {"type": "object", "properties": {"a": rng.choice(leaves)}, "required": rng.choice([["a"], [], ["zz"]])},
                    rng.choice(leaves)])}} for _ in range(rng.randint(0, 3))]  # fmt: skip
        if rng.random() < 0.1:
            fns = rng.choice(["tools", 3, [1, 2], {"a": 1}])
        choice = rng.choice([None, "none", "auto", "required", "any", named("f"), named("zz"), {"type": "function"}, 3])
        messages = list(CHAT)
        if rng.random() < 0.2:
            messages += [{"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c", "type": "function", "function": {"name": "f", "arguments": rng.choice(["{}", "{", "[]"])}}]},
                         {"role": "tool", "content": "ok", **({"tool_call_id": "c"} if rng.random() < 0.5 else {})}]  # fmt: skip
        body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0, "tools": fns, "tool_choice": choice}
        if rng.random() < 0.2:
            body["parallel_tool_calls"] = rng.choice([True, False, "yes", 1])
        out.append(body)
    return out


@pytest.mark.e2e
def test_fuzzed_tool_bodies_are_answered_or_refused_never_a_500_and_neighbours_finish(served):
    """300 tool bodies (malformed schemas, unknown names in tool_choice, tool messages without an id)
    beside valid requests: each is a 200 or a 400 naming a field, never a 500, and the neighbours'
    answers are unchanged."""
    import concurrent.futures

    import httpx

    want = ask(served, "none", tool_choice="required")

    def post(body) -> tuple[int, str | None]:
        r = httpx.post(f"{served.url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer test"}, timeout=60)
        return r.status_code, (r.json().get("error") or {}).get("param") if r.status_code != 200 else None

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        fuzzed, neighbours = [], []
        for i, body in enumerate(fuzzed_tool_bodies(300, served.model)):
            fuzzed.append(pool.submit(post, body))
            if i % 30 == 15:
                neighbours.append(pool.submit(ask, served, "draft", CHAT, False, tool_choice="required"))
        results = [f.result() for f in fuzzed]
        assert all(n.result() == want for n in neighbours)
    assert {s for s, _ in results} <= {200, 400}, sorted({s for s, _ in results})
    assert all(param for s, param in results if s == 400), [r for r in results if r[0] == 400 and not r[1]][:3]
    assert sum(s == 200 for s, _ in results) >= 10 and sum(s == 400 for s, _ in results) >= 100
