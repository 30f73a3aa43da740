"""Strict JSON-schema answers through the official ``openai`` client against ``serve`` on the bundled
pair (issue 72): every answer parses and follows its schema, streamed equals non-streamed, greedy
answers are identical across drafters, and how fast each drafter (and the grammar's forced tokens)
makes the constrained target.

    python scripts/experiments/check_json_served.py --prompts 50 --max-tokens 128 --out docs/experiments/data

Prompts: the held-out ``extract`` family of ``serving/prompts.py`` (lists copied out of a text,
answered as ``{"items": [...]}``) and generated ones (an invoice's vendor, date, amount and currency;
a person's name, age and city; a meeting's date, time and attendees), each with its strict schema.
``serve`` runs with an untrained router over the bundled 0.5B draft (only its drafter names matter:
each request forces its drafter with the ``draft`` body field), one request at a time, drafters
interleaved per prompt. Writes ``json_served.json`` under ``--out`` (``json_served_from_N.json`` with
``--start N``: the prompts after an earlier run's first N).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
DRAFTERS = ("none", "grammar", "draft", "suffix", "auto")
ITEMS = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}}, "required": ["items"],
         "additionalProperties": False}  # fmt: skip
INVOICE = {"type": "object", "properties": {"vendor": {"type": "string"}, "date": {"type": "string"}, "amount": {"type": "number"},
                                            "currency": {"enum": ["USD", "EUR", "GBP"]}},
           "required": ["vendor", "date", "amount", "currency"], "additionalProperties": False}  # fmt: skip
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}  # fmt: skip
MEETING = {"type": "object", "properties": {"date": {"type": "string"}, "time": {"type": "string"},
                                            "attendees": {"type": "array", "items": {"type": "string"}}},
           "required": ["date", "time", "attendees"], "additionalProperties": False}  # fmt: skip


def generated(n: int, seed: int = 0) -> list[tuple[str, str, dict]]:
    """``n`` synthetic extraction prompts (id, text, schema): invoices, people, meetings."""
    rng = random.Random(seed)
    names = ["Ada Okafor", "Lena Fischer", "Ravi Menon", "Tomás Ruiz", "Mei Chen", "Jonas Berg", "Aisha Khan", "Pierre Dubois"]
    cities = ["Lisbon", "Osaka", "Nairobi", "Toronto", "Krakow", "Lima", "Perth", "Dublin"]
    vendors = ["Acme Tools Ltd", "Northwind Traders", "Blue Harbor Supplies", "Globex GmbH", "Initech Services"]
    out = []
    for i in range(n):
        date = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        if i % 3 == 0:
            amount, cur = round(rng.uniform(20, 5000), 2), rng.choice(["USD", "EUR", "GBP"])
            text = (f"Extract the vendor, the invoice date, the total amount and its currency from this invoice as JSON.\n\n"
                    f"Invoice no. {rng.randint(1000, 9999)} from {rng.choice(vendors)}, issued {date}. Items: "
                    f"{rng.randint(2, 9)} boxes of screws, shipping. Total due: {amount} {cur}.")  # fmt: skip
            out.append((f"gen-invoice-{i}", text, INVOICE))
        elif i % 3 == 1:
            name, city = rng.choice(names), rng.choice(cities)
            text = (f"Extract the person's name, age and city from this note as JSON.\n\n"
                    f"Note: {name} moved to {city} last spring; at {rng.randint(19, 80)} she still runs every morning.")
            out.append((f"gen-person-{i}", text, PERSON))
        else:
            who = rng.sample(names, rng.randint(2, 4))
            text = (f"Extract the meeting's date, time and attendees from this message as JSON.\n\n"
                    f"Hi all, the design review is on {date} at {rng.randint(8, 17)}:{rng.choice(['00', '30'])}. "
                    f"Invited: {', '.join(who)}.")
            out.append((f"gen-meeting-{i}", text, MEETING))
    return out


def follows(value, schema: dict) -> bool:
    """Whether ``value`` follows one of the script's schemas (objects, arrays, strings, numbers, enums)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and set(schema.get("required", [])) <= set(value)
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(follows(value[k], props[k]) for k in value if k in props))  # fmt: skip
    if kind == "array":
        return isinstance(value, list) and all(follows(v, schema.get("items", {})) for v in value)
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


def prompts(n: int) -> list[tuple[str, str, dict]]:
    from serving.prompts import load_grounded

    extract = [(g.prompt.id, g.prompt.text + '\n\nAnswer as {"items": [...]}.', ITEMS) for g in load_grounded("extract", n // 2)]
    made = generated(n - len(extract))
    # Interleaved, so a run cut short still holds both kinds.
    return [p for pair in zip(extract, made) for p in pair] + extract[len(made):] + made[len(extract):]


def write(rows: list[dict], args) -> dict:
    """The summary of the rows so far, written to ``--out`` (after every prompt: a run cut short keeps what it measured)."""
    from serving.engine.devices import describe_machine
    from serving.files import atomic_path

    summary = {}
    for drafter in DRAFTERS:
        answers = [r["answers"][drafter] for r in rows]
        calls = sum(a["target_calls"] or 0 for a in answers)
        summary[drafter] = {
            "valid": sum(a["valid"] for a in answers), "stop": sum(a["finish_reason"] == "stop" for a in answers),
            "identical_to_target_alone": sum(a["content"] == r["answers"]["none"]["content"] for a, r in zip(answers, rows)),
            "tokens_per_s": sum(a["tokens"] for a in answers) / sum(a["seconds"] for a in answers),
            "tokens_per_call": sum(a["tokens"] for a in answers) / max(1, calls),
            "grammar_share": sum((a["drafter_shares"] or {}).get("grammar", 0.0) for a in answers) / max(1, len(answers)),
        }  # fmt: skip
    base = summary["none"]["tokens_per_s"]
    for s in summary.values():
        s["speedup"] = s["tokens_per_s"] / base
    result = {"date": datetime.date.today().isoformat(), "machine": describe_machine(with_threads=True),
              "command": "python " + " ".join(sys.argv), "prompts": len(rows),
              "streamed_equal": [r["streamed_equal"] for r in rows if "streamed_equal" in r], "summary": summary, "rows": rows}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "json_served.json" if not args.start else f"json_served_from_{args.start}.json"
    with atomic_path(out / name) as tmp:
        tmp.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--start", type=int, default=0, help="skip the first prompts (a run that adds to an earlier one)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--streamed", type=int, default=5, help="prompts also sent streamed (with the 0.5B draft)")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra key=value for serve (repeatable)")
    ap.add_argument("--out", default="runs/json-served")
    args = ap.parse_args(argv)

    from serving.server.launch import serving_drafts

    cases = prompts(args.prompts)[args.start :]
    rows = []
    with serving_drafts(args.target, {"draft": args.draft}, args.serve_arg) as (client, model):
        for i, (pid, text, schema) in enumerate(cases):
            fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
            row = {"id": pid, "answers": {}}
            for drafter in DRAFTERS:
                kw = dict(model=model, messages=[{"role": "user", "content": text}], max_tokens=args.max_tokens, temperature=0,
                          response_format=fmt, extra_body={"draft": drafter})  # fmt: skip
                started = time.perf_counter()
                r = client.chat.completions.create(**kw)
                seconds = time.perf_counter() - started
                content = r.choices[0].message.content
                try:
                    valid = follows(json.loads(content), schema)
                except json.JSONDecodeError:
                    valid = False
                choral = (r.model_extra or {}).get("choral", {})
                row["answers"][drafter] = {"content": content, "valid": valid, "finish_reason": r.choices[0].finish_reason,
                                           "tokens": r.usage.completion_tokens, "seconds": seconds,
                                           "target_calls": choral.get("target_calls"), "drafter_shares": choral.get("drafter_shares")}  # fmt: skip
                if drafter == "draft" and i < args.streamed:
                    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                                       if c.choices)  # fmt: skip
                    row["streamed_equal"] = streamed == content
            rows.append(row)
            write(rows, args)
            a = row["answers"]
            print(f"{pid}: " + ", ".join(f"{d} {a[d]['tokens'] / a[d]['seconds']:.1f} tok/s{'' if a[d]['valid'] else ' INVALID'}"
                                         for d in DRAFTERS), flush=True)  # fmt: skip
    result = write(rows, args)
    print(json.dumps({"summary": result["summary"], "streamed_equal": result["streamed_equal"]}, indent=1))
    summary = result["summary"]
    ok = all(s["valid"] == len(rows) and s["identical_to_target_alone"] == len(rows) for s in summary.values())
    return 0 if ok and all(result["streamed_equal"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
