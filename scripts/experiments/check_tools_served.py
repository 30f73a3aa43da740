"""Tool calls through the official ``openai`` client against ``serve`` on the bundled pair (issue 73):
held-out tool-use prompts (2-4 functions each) with named, required and auto choices; every call's
arguments follow its function's schema; a second turn with the tool's result completes; each
drafter's answer is the target alone's.

    python scripts/experiments/check_tools_served.py --prompts 20 --out docs/experiments/data

The prompts are written here (not from the training or router data): each names a situation, the
functions an assistant has, and the tool_choice (rotating named, required, auto). Every prompt goes
to every drafter in ``--drafters`` (greedy, one request at a time; the first is the target alone),
then a second turn (the first call answered with a made-up result, ``tool_choice`` none) goes to
the target alone and to ``auto``. Writes ``tools_served.json`` under ``--out`` after every prompt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_json_served import follows  # noqa: E402  (a sibling script)

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def fn(name: str, description: str, props: dict, required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": list(props) if required is None else required,
        "additionalProperties": False}}}  # fmt: skip


S, I, N = {"type": "string"}, {"type": "integer"}, {"type": "number"}
WEATHER = fn("get_weather", "Current weather for a city", {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"])
TIME = fn("get_time", "Current time in an IANA time zone", {"timezone": S})
EMAIL = fn("send_email", "Send an email", {"to": S, "subject": S, "body": S})
CALENDAR = fn("create_event", "Add a calendar event", {"title": S, "date": S, "time": S, "attendees": {"type": "array", "items": S}})
CALC = fn("calculate", "Evaluate an arithmetic expression", {"expression": S})
CONVERT = fn("convert_units", "Convert a quantity between units", {"value": N, "from_unit": S, "to_unit": S})
STOCK = fn("get_stock_price", "Latest price of a stock ticker", {"ticker": S})
SEARCH = fn("search_web", "Search the web", {"query": S, "max_results": I}, ["query"])
TRANSLATE = fn("translate", "Translate text", {"text": S, "target_language": S})
FLIGHT = fn("book_flight", "Book a flight", {"origin": S, "destination": S, "date": S, "passengers": I})
TICKET = fn("create_ticket", "Open a support ticket", {"title": S, "priority": {"enum": ["low", "medium", "high"]}, "description": S})
FILES = fn("list_files", "List the files of a directory", {"path": S})
RUN = fn("run_tests", "Run a test suite", {"path": S, "verbose": {"type": "boolean"}}, ["path"])
COMMIT = fn("git_commit", "Commit staged changes", {"message": S})

# (user message, tools, the function a named choice names)
CASES = [
    ("What's the weather like in Lisbon right now, in celsius?", [WEATHER, TIME], "get_weather"),
    ("What time is it in Tokyo (Asia/Tokyo)?", [WEATHER, TIME, SEARCH], "get_time"),
    ("Email alice@example.com that the report is ready, subject 'Report'.", [EMAIL, CALENDAR], "send_email"),
    ("Put a meeting 'Design review' on 2027-01-12 at 10:00 with Bob and Mei on my calendar.", [CALENDAR, EMAIL, TIME], "create_event"),
    ("How much is 17.5 * 42 - 8?", [CALC, CONVERT], "calculate"),
    ("Convert 12 miles to kilometers.", [CONVERT, CALC, SEARCH], "convert_units"),
    ("What is Apple's stock (AAPL) trading at?", [STOCK, SEARCH], "get_stock_price"),
    ("Find me three articles about speculative decoding.", [SEARCH, TRANSLATE, STOCK], "search_web"),
    ("Translate 'good morning, team' into German.", [TRANSLATE, SEARCH], "translate"),
    ("Book a flight from Oslo to Lima on 2027-03-02 for two passengers.", [FLIGHT, WEATHER, CALENDAR], "book_flight"),
    ("The login page returns a 500 error for every user; open a high priority ticket.", [TICKET, EMAIL], "create_ticket"),
    ("Which files are in the src/ directory?", [FILES, RUN, COMMIT], "list_files"),
    ("Run the tests under tests/unit verbosely.", [RUN, FILES, COMMIT], "run_tests"),
    ("Commit the staged changes with the message 'Fix the parser's off-by-one'.", [COMMIT, RUN, FILES, TICKET], "git_commit"),
    ("Is it raining in Dublin? Use fahrenheit.", [WEATHER, SEARCH, TIME], "get_weather"),
    ("Tell Pierre (pierre@example.org) the launch moved to Friday.", [EMAIL, TRANSLATE, CALENDAR], "send_email"),
    ("What's 2 to the power of 16, divided by 8?", [CALC, SEARCH], "calculate"),
    ("How many liters are 3 US gallons?", [CONVERT, CALC], "convert_units"),
    ("Look up the price of NVDA and of MSFT.", [STOCK, SEARCH, CALC], "get_stock_price"),
    ("Schedule 'Quarterly planning' for 2027-04-01 at 14:30 with Ada, Jonas and Ravi.", [CALENDAR, TIME, EMAIL, TICKET], "create_event"),
]
CHOICES = ("named", "required", "auto")


def valid_call(call, tools: list[dict]) -> bool:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    try:
        args = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return False
    return call.function.name in schemas and follows(args, schemas[call.function.name])


def streamed(client, model: str, messages: list, tools: list, choice, max_tokens: int, draft: str) -> tuple:
    """(content, [[name, arguments]]) of a streamed answer, assembled from its deltas as a client does."""
    content, calls = "", {}
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=choice, stream=True,
                                                max_tokens=max_tokens, temperature=0, extra_body={"draft": draft}):  # fmt: skip
        delta = chunk.choices[0].delta if chunk.choices else None
        content += (delta.content or "") if delta else ""
        for c in (delta.tool_calls or []) if delta else []:
            entry = calls.setdefault(c.index, ["", ""])
            entry[0] += c.function.name or ""
            entry[1] += c.function.arguments or ""
    return content or None, [calls[i] for i in sorted(calls)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--drafters", default="none,draft,suffix,auto", help="the first is the reference (the target alone)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra key=value for serve (repeatable)")
    ap.add_argument("--out", default="runs/tools-served")
    args = ap.parse_args(argv)

    from serving.engine.devices import describe_machine
    from serving.files import atomic_path
    from serving.server.launch import serving_drafts

    drafters = args.drafters.split(",")
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with serving_drafts(args.target, {"draft": args.draft}, args.serve_arg) as (client, model):
        for i, (text, tools, name) in enumerate(CASES[: args.prompts]):
            kind = CHOICES[i % 3]
            choice = {"type": "function", "function": {"name": name}} if kind == "named" else kind
            messages = [{"role": "user", "content": text}]
            row = {"prompt": text, "tool_choice": kind, "functions": [t["function"]["name"] for t in tools], "answers": {}}
            for d in drafters:
                started = time.perf_counter()
                r = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=choice,
                                                   max_tokens=args.max_tokens, temperature=0, extra_body={"draft": d})  # fmt: skip
                m = r.choices[0].message
                row["answers"][d] = {"content": m.content, "finish_reason": r.choices[0].finish_reason,
                                     "calls": [[c.function.name, c.function.arguments] for c in m.tool_calls or []],
                                     "valid": all(valid_call(c, tools) for c in m.tool_calls or []),
                                     "tokens": r.usage.completion_tokens, "seconds": time.perf_counter() - started}  # fmt: skip
                if d == drafters[0]:
                    calls = m.tool_calls or []
            if kind == "auto":  # streamed too: held-back text and calls assembled from the deltas
                row["streamed_identical"] = streamed(client, model, messages, tools, choice, args.max_tokens, drafters[-1]) == (
                    row["answers"][drafters[-1]]["content"], row["answers"][drafters[-1]]["calls"])
            ref = row["answers"][drafters[0]]
            row["identical"] = {d: a["content"] == ref["content"] and [c[0] for c in a["calls"]] == [c[0] for c in ref["calls"]]
                                and [json.loads(c[1]) for c in a["calls"]] == [json.loads(c[1]) for c in ref["calls"]]
                                for d, a in row["answers"].items()}  # fmt: skip
            if calls:  # the second turn: the first call answered
                turn = [*messages, {"role": "assistant", "content": None, "tool_calls": [
                            {"id": calls[0].id, "type": "function", "function": {"name": calls[0].function.name,
                                                                                 "arguments": calls[0].function.arguments}}]},
                        {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"result": "ok", "value": 42})}]  # fmt: skip
                second = {}
                for d in (drafters[0], "auto"):
                    r = client.chat.completions.create(model=model, messages=turn, tools=tools, tool_choice="none",
                                                       max_tokens=args.max_tokens, temperature=0, extra_body={"draft": d})  # fmt: skip
                    second[d] = {"content": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason}
                row["second_turn"] = second
            rows.append(row)
            summary = {
                "prompts": len(rows),
                "called": sum(bool(r["answers"][drafters[0]]["calls"]) for r in rows),
                "valid_arguments": sum(r["answers"][drafters[0]]["valid"] and bool(r["answers"][drafters[0]]["calls"]) for r in rows),
                "by_choice": {k: sum(bool(r["answers"][drafters[0]]["calls"]) for r in rows if r["tool_choice"] == k) for k in CHOICES},
                "streamed_identical": f"{sum(r.get('streamed_identical', False) for r in rows)}/{sum('streamed_identical' in r for r in rows)}",
                "second_turn_completed": sum(bool(r.get("second_turn", {}).get(drafters[0], {}).get("content")) for r in rows),
                "second_turn_identical": sum(len({json.dumps(v) for v in r["second_turn"].values()}) == 1 for r in rows if "second_turn" in r),
                "identical_to_target_alone": {d: sum(r["identical"][d] for r in rows) for d in drafters},
                "tokens_per_s": {d: sum(r["answers"][d]["tokens"] for r in rows) / sum(r["answers"][d]["seconds"] for r in rows)
                                 for d in drafters},
            }  # fmt: skip
            result = {"date": datetime.date.today().isoformat(), "machine": describe_machine(with_threads=True),
                      "command": "python " + " ".join(sys.argv), "summary": summary, "rows": rows}  # fmt: skip
            with atomic_path(out / "tools_served.json") as tmp:
                tmp.write_text(json.dumps(result, indent=1) + "\n")
            a = row["answers"][drafters[0]]
            print(f"{i}: {kind} -> {a['calls'] or a['content']!r:.120} valid={a['valid']} identical={row['identical']}", flush=True)
    print(json.dumps(summary, indent=1))
    ok = summary["streamed_identical"].split("/")[0] == summary["streamed_identical"].split("/")[1] and summary["valid_arguments"] == summary["called"] and all(v == len(rows) for v in summary["identical_to_target_alone"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
