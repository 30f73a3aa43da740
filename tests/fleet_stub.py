"""A stand-in for one vLLM replica, for the fleet front's tests where vLLM is not installed: the
endpoints and metric names the front reads (``/health``, ``/v1/models``, ``/metrics`` with
``vllm:num_requests_running``/``waiting`` and, when it "drafts", vLLM's speculative counters, which
``scripts/experiments/bench_vllm_fleet.py profile`` reads too: every completion of n tokens counts
as n // 2 accepted draft tokens, all at the first position, in n - n // 2 - 1 steps that drafted 4),
and completions whose text names the replica, one token per ``--delay`` seconds. With ``--hold
FILE`` every completion waits, once it is running, until FILE exists: a test decides when answers
may finish instead of betting on how long they take.

    python -m tests.fleet_stub --port 8101 --model /models/target --name plain [--spec] [--delay 0.01] [--hold FILE]

The real thing runs in the ``vllm`` test tier (tests/test_vllm_fleet.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def create_app(model: str, name: str, spec: bool, delay: float, hold: str | None = None) -> FastAPI:
    app = FastAPI()
    state = {"running": 0, "served": 0, "drafts": 0, "accepted": 0}

    async def held() -> None:
        while hold is not None and not Path(hold).exists():
            await asyncio.sleep(0.01)

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "vllm"}]}

    @app.get("/metrics")
    async def metrics():
        lines = [
            "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{model_name="{model}"}} {state["running"]}',
            "# TYPE vllm:num_requests_waiting gauge", f'vllm:num_requests_waiting{{model_name="{model}"}} 0',
        ]  # fmt: skip
        if spec:  # counters as prometheus_client writes them: TYPE and samples named NAME_total
            label = f'model_name="{model}"'
            lines += ["# TYPE vllm:spec_decode_num_drafts_total counter",
                      f'vllm:spec_decode_num_drafts_total{{{label}}} {state["drafts"]}',
                      "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
                      f'vllm:spec_decode_num_draft_tokens_total{{{label}}} {4 * state["drafts"]}',
                      "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
                      f'vllm:spec_decode_num_accepted_tokens_total{{{label}}} {state["accepted"]}',
                      "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]  # fmt: skip
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{i}"}} {state["accepted"] if i == 0 else 0}'
                      for i in range(4)]  # fmt: skip
        return PlainTextResponse("\n".join(lines) + "\n")

    async def generate(request: Request, chat: bool):
        body = await request.json()
        if body.get("model") != model:
            return JSONResponse({"error": {"message": f"The model `{body.get('model')}` does not exist.", "type": "NotFoundError",
                                           "param": None, "code": 404}}, status_code=404)  # fmt: skip
        n = int(body.get("max_tokens") or 16)
        if n > 1000:
            return JSONResponse({"error": {"message": "max_tokens is too large", "type": "BadRequestError", "param": None,
                                           "code": 400}}, status_code=400)  # fmt: skip
        state["running"] += 1
        if spec:
            state["accepted"] += n // 2
            state["drafts"] += max(0, n - n // 2 - 1)
        words = [f"{name}{i} " for i in range(n)]
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None) -> dict:
            if chat:
                return {"index": 0, "delta" if body.get("stream") else "message": {"role": "assistant", "content": text},
                        "finish_reason": finish}  # fmt: skip
            return {"index": 0, "text": text, "finish_reason": finish}

        if not body.get("stream"):
            try:
                await held()
                await asyncio.sleep(delay * n)
            finally:
                state["running"] -= 1
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
            return {"id": "x", "object": kind, "created": int(time.time()), "model": model,
                    "choices": [choice("".join(words), "length")], "usage": usage}  # fmt: skip

        async def events():
            try:
                await held()
                for i, w in enumerate(words):
                    await asyncio.sleep(delay)
                    chunk = {"id": "x", "object": f"{kind}.chunk", "created": 0, "model": model,
                             "choices": [choice(w, "length" if i == n - 1 else None)]}  # fmt: skip
                    yield f"data: {json.dumps(chunk)}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
                    yield f"data: {json.dumps({'id': 'x', 'object': kind + '.chunk', 'model': model, 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["running"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, chat=True)

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--spec", action="store_true")
    ap.add_argument("--delay", type=float, default=0.005)
    ap.add_argument("--hold", default=None, help="completions wait until this file exists")
    a = ap.parse_args()
    uvicorn.run(create_app(a.model, a.name, a.spec, a.delay, a.hold), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
