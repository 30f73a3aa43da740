"""``choral-demo``: a web page that shows speculative decoding as it happens.

    pip install -e ".[bundled,demo]"
    choral-demo                                              # starts serve in this process on the bundled pair
    choral-demo --url http://127.0.0.1:8000/v1 --api-key KEY # or talks to a running serve

Type a prompt, pick a drafter (``routed``: the server's router decides; or any drafter the server
has), and run: the answer streams with each token marked by how it came (an accepted draft token
of which drafter, the target's correction after a rejection, its bonus token after a fully
accepted block, or the target's own token in a step that drafted nothing), read from each
chunk's ``choral.tokens``. Then the same prompt runs with the target alone (after, never at the
same time: two runs would share the cores) and the page compares tokens per second, acceptance,
tokens per target call and the router's choice. Everything comes through the official ``openai``
client, as any user's would; the demo has no access to the engine that the API does not give.
"""

from __future__ import annotations

import argparse
import html
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

ROUTED = "routed"
ORIGINS = {  # origin -> (legend label, colour)
    "draft": ("accepted draft token", "#b7e4c7"),
    "correction": ("target's correction", "#ffd6a5"),
    "bonus": ("target's bonus token", "#bde0fe"),
    "target": ("target alone", "#e9ecef"),
    "grammar": ("the JSON grammar's forced token (a free draft)", "#e0c3fc"),
}
JSON_MODE = {"type": "json_object"}  # the page's JSON mode: OpenAI's response_format
CSS = """
.tokens { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 14px; line-height: 1.6; }
.tok { border-radius: 3px; }
""" + "".join(f".tok.{o} {{ background: {c}; }}\n" for o, (_, c) in ORIGINS.items())


@dataclass
class Run:
    """One streamed answer: its token entries as they came, the final ``choral`` summary, timings."""

    draft: str | None  # forced drafter, None: routed
    entries: list[dict] = field(default_factory=list)  # {"text", "origin", "drafter"} per token
    text: str = ""
    summary: dict = field(default_factory=dict)
    seconds: float = 0.0
    done: bool = False

    @property
    def tokens_per_second(self) -> float:
        return len(self.entries) / self.seconds if self.seconds else 0.0


def stream(client: Any, model: str, prompt: str, draft: str | None, max_tokens: int,
           response_format: dict | None = None) -> Iterator[Run]:  # fmt: skip
    """Stream one greedy chat answer, yielding the run after each chunk (and once when done).
    ``response_format``: OpenAI's (JSON mode, a JSON schema), or None for free text."""
    run = Run(draft)
    started = time.perf_counter()
    extra = {"draft": draft} if draft is not None else {}
    fmt = {"response_format": response_format} if response_format is not None else {}
    chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True, extra_body=extra, **fmt)  # fmt: skip
    for chunk in chunks:
        choral = (chunk.model_extra or {}).get("choral") or {}
        text = chunk.choices[0].delta.content if chunk.choices else None
        if text:
            run.text += text
            # Older servers send no token origins: the text then shows unmarked.
            run.entries += choral.get("tokens") or [{"text": text, "origin": None, "drafter": None}]
        if chunk.choices and chunk.choices[0].finish_reason:
            run.summary = {k: v for k, v in choral.items() if k != "tokens"}
        run.seconds = time.perf_counter() - started
        yield run
    run.done = True
    yield run


def render_tokens(run: Run | None) -> str:
    """The answer as HTML: one span per token, its class the token's origin (an accepted draft the
    grammar forced: ``grammar``)."""
    if run is None:
        return "<div class='tokens'></div>"
    spans = []
    for e in run.entries:
        origin = e.get("origin") or "plain"
        if origin == "draft" and e.get("drafter") == "grammar":
            origin = "grammar"
        title = f"{origin}" + (f" ({e['drafter']})" if e.get("drafter") else "")
        drafter = f" data-drafter='{html.escape(e['drafter'], quote=True)}'" if e.get("drafter") else ""
        spans.append(f"<span class='tok {origin}' title='{html.escape(title, quote=True)}'{drafter}>"
                     f"{html.escape(e.get('text', ''))}</span>")  # fmt: skip
    return f"<div class='tokens' data-done='{str(run.done).lower()}'>{''.join(spans)}</div>"


def legend() -> str:
    return " ".join(f"<span class='tok {o}' style='padding:0 4px'>{label}</span>" for o, (label, _) in ORIGINS.items())


def render_summary(spec: Run | None, alone: Run | None) -> str:
    """The comparison as a small markdown table."""
    if spec is None:
        return ""
    s = spec.summary
    rows = ["| | speculative | target alone |", "|---|---|---|"]
    alone_tps = f"{alone.tokens_per_second:.1f}" if alone and alone.done else "…"
    rows.append(f"| tokens/s | {spec.tokens_per_second:.1f} | {alone_tps} |")
    rows.append(f"| tokens | {len(spec.entries)} | {len(alone.entries) if alone else '…'} |")
    if spec.done:
        rows.append(f"| drafter | {s.get('draft')} ({'forced' if s.get('forced') else 'routed'}) | none |")
        rows.append(f"| router's choice | {s.get('router_choice') or '-'} | |")
        rows.append(f"| acceptance | {s.get('acceptance_rate', 0.0):.2f} | |")
        rows.append(f"| tokens per target call | {s.get('tokens_per_target_call', 0.0):.2f} | 1.00 |")
    if spec.done and alone and alone.done and alone.tokens_per_second:
        rows.append(f"| speedup | **{spec.tokens_per_second / alone.tokens_per_second:.2f}x** | 1.00x |")
        same = "yes" if spec.text == alone.text else "no"
        rows.append(f"| same text as the target alone | {same} | |")
    return "\n".join(rows)


def build_page(client: Any, model: str, drafters: list[str], max_tokens: int = 128):
    """The Gradio page over an OpenAI client of a running ``serve``."""
    import gradio as gr

    def run(prompt: str, drafter: str, json_mode: bool = False) -> Iterator[tuple[str, str, str]]:
        if not prompt.strip():
            yield render_tokens(None), render_tokens(None), "Type a prompt first."
            return
        forced = None if drafter == ROUTED else drafter
        spec = None
        fmt = JSON_MODE if json_mode else None
        for spec in stream(client, model, prompt, forced, max_tokens, fmt):
            yield render_tokens(spec), render_tokens(None), render_summary(spec, None)
        alone = None
        for alone in stream(client, model, prompt, "none", max_tokens, fmt):  # after: two runs would share the cores
            yield render_tokens(spec), render_tokens(alone), render_summary(spec, alone)

    with gr.Blocks(title="Choral: speculative decoding, live") as page:
        gr.Markdown("## Choral: speculative decoding, live\nA drafter proposes tokens, the target checks them all "
                    "in one forward pass; the output is the target's own. " + legend())  # fmt: skip
        with gr.Row():
            prompt = gr.Textbox(label="prompt", lines=3, elem_id="prompt", scale=4,
                                value="Write a Python function that checks whether a string is a palindrome.")  # fmt: skip
            with gr.Column(scale=1):
                drafter = gr.Dropdown([ROUTED, *drafters], value=ROUTED, label="drafter", elem_id="drafter")
                json_mode = gr.Checkbox(False, label="JSON mode (response_format json_object)", elem_id="json")
                go = gr.Button("Run", variant="primary", elem_id="run")
        gr.Markdown("**Speculative** (each token marked by how it came)")
        answer = gr.HTML(render_tokens(None), elem_id="answer")
        gr.Markdown("**Target alone**, run after it")
        alone = gr.HTML(render_tokens(None), elem_id="alone")
        summary = gr.Markdown(elem_id="summary")
        go.click(run, [prompt, drafter, json_mode], [answer, alone, summary])
    return page


def start_local_server(router: str | None, overrides: list[str]) -> tuple[str, Any]:
    """``serve`` in this process (uvicorn in a thread) on a free loopback port, on ``router`` or,
    without one, on an untrained router over the bundled 0.5B draft (its choices are arbitrary;
    pick a drafter by hand, or pass a trained router.pt). Returns (base URL, the uvicorn server)."""
    import uvicorn

    from serving.config import load_config
    from serving.server.app import create_app
    from serving.server.connections import uvicorn_config
    from serving.server.launch import free_port
    from serving.server.serve_config import ServeConfig
    from serving.server.server import EngineServer

    if router is None:
        from routing.router import Router

        router = str(Path(tempfile.mkdtemp(prefix="choral-demo-")) / "router.pt")
        Router.create({"draft": "qwen2.5-coder-0.5b-instruct"}, "qwen2.5-coder-1.5b-instruct").save(router)
    port = free_port()
    cfg = load_config(ServeConfig, None, [f"router={router}", f"port={port}", "log_level=warning", *overrides])
    server = uvicorn.Server(uvicorn_config(create_app(EngineServer(cfg), cfg), cfg, host="127.0.0.1"))
    threading.Thread(target=server.run, name="choral-demo-serve", daemon=True).start()
    return f"http://127.0.0.1:{port}/v1", server


def connect(url: str, api_key: str | None, timeout_s: float = 900.0) -> tuple[Any, str, list[str]]:
    """(openai client, model id, the server's drafter names), once the server answers /v1/models
    (loading and warming up the bundled pair takes minutes the first time)."""
    import openai

    client = openai.OpenAI(base_url=url, api_key=api_key or "none", max_retries=0, timeout=300)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            [model] = client.models.list().data
            break
        except (openai.APIConnectionError, openai.APIStatusError):
            if time.monotonic() > deadline:
                raise SystemExit(f"choral-demo: {url} did not answer /v1/models within {timeout_s:.0f} s") from None
            time.sleep(1.0)
    drafters = [d for d in ((model.model_extra or {}).get("choral") or {}).get("drafts", []) if d != "none"]
    return client, model.id, drafters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="choral-demo", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--url", help="a running serve's OpenAI base URL (http://HOST:PORT/v1); default: start one here")
    ap.add_argument("--api-key", help="the server's API key, if it has one")
    ap.add_argument("--router", help="without --url: the router.pt to serve (default: an untrained one over the bundled pair)")
    ap.add_argument("--host", default="127.0.0.1", help="where the page listens")
    ap.add_argument("--port", type=int, default=7860, help="the page's port")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per answer")
    ap.add_argument("overrides", nargs="*", help="without --url: serve's key=value settings (e.g. engine.max_batch_size=2)")
    args = ap.parse_args(argv)
    try:
        import gradio  # noqa: F401
    except ImportError:
        print('choral-demo: gradio is not installed; install the demo extra: pip install -e ".[demo]"', file=sys.stderr)
        return 2
    url = args.url
    if url is None:
        url, _ = start_local_server(args.router, args.overrides)
        print(f"choral-demo: serve is starting in this process at {url} (the bundled pair loads first)", flush=True)
    client, model, drafters = connect(url, args.api_key)
    page = build_page(client, model, drafters, args.max_tokens)
    print(f"choral-demo: open http://{args.host}:{args.port}", flush=True)
    page.launch(server_name=args.host, server_port=args.port, css=CSS, show_error=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
