"""The Choral engine's backend of ``serve`` (``backend=choral``): loading, and the request path.

    app = create_app(EngineServer(cfg), cfg)    # serving.server.app

``load_models`` reads the router, builds the engine with ``serving.engine.loader.load_engine``
as every command does (one ``SpeculativeEngine`` holding every drafter the router names, the
built-in model-free ones and ``none``; on the target model in fused mode, on a
``serving.distributed.remote.RemoteVerifier`` in the draft role), and warms every drafter up.
``EngineServer`` loads on a background thread after the app starts, so ``/health`` answers 503
("loading") until then, and 200 after. A request is parsed and checked (the model, a forced
drafter, the context) and tokenized off the event loop, then handed to the ``Scheduler`` thread
that owns the engine; its tokens come back as events, streamed or collected, and its ``choral``
object says what speculation did for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request as HTTPRequest

from routing.router import Router
from serving.distributed.remote import RemoteVerifier, TargetUnavailable
from serving.engine import Request
from serving.engine.drafters.base import NONE, PREDICTION
from serving.engine.drafters.registry import named_refs
from serving.engine.loader import load_engine
from serving.engine.models import load_tokenizer
from serving.engine.grammar import GrammarError, grammars_for, json_schema_grammar
from serving.engine.sampling import SamplingParams
from serving.server.admission import client_id
from serving.server.detokenize import IncrementalDetokenizer, fit_texts, token_texts
from serving.server.http import check_model, json_error, not_ready, read_body, requested_draft, wait_disconnect
from serving.server.logprobs import TokenStrings, chat_logprobs, completion_logprobs, text_offsets
from serving.server.metrics import ServerMetrics
from serving.server.openai_api import (
    APIError, ChatCompletionRequest, CompletionRequest, chunk_body, completion_body, new_id, parse_request, sampling_error,
    sse, usage,
)  # fmt: skip
from serving.server.request_log import RequestLog
from serving.server.scheduler import Engine, Failed, Finished, Routed, Scheduler, Ticket, Tokens
from serving.server.serve_config import ServeConfig
from serving.server.tools import (HERMES, NO_FORMAT, ToolError, Tools, chat_messages, finish_reason, may_open, parse_calls,
                                  parse_tools, template_format, tool_grammar)  # fmt: skip

TOOL_FIELDS = frozenset({"tools", "tool_choice"})  # OpenAI fields the chat endpoint implements here (serving.server.tools)

log = logging.getLogger("choral.server")


@dataclass
class LoadedModels:
    """Everything loaded: the engine (it holds every drafter), the router, and a tokenizer of the
    HTTP side's own (the engine's tokenizer is used on the scheduler thread; HF fast tokenizers
    must not be shared between threads)."""

    engine: Engine
    router: Any  # routing.Router
    tokenizer: Any
    model_name: str
    max_len: int
    reserve: int  # context kept free for speculation: K + 1 of the largest K a row may draft (1 without drafting)
    unavailable: tuple[type[BaseException], ...] = ()  # step() errors that mean "target down"


def load_served_engine(cfg: ServeConfig, router: Any) -> tuple[Any, Engine, tuple[type[BaseException], ...]]:
    """The tokenizer, the engine and the exceptions that mean the target is unreachable. One
    engine (one target, one KV cache, one batch) holds every drafter the router names, the
    built-in model-free ones (``ngram``, ``suffix``, ``prediction``) and ``none``; each request's
    row drafts with its own. role=draft: it verifies on ``cfg.target_address``."""
    drafters = {name: router.draft_refs.get(name) for name in router.draft_names if name != NONE}
    for builtin in named_refs():  # ngram, suffix and auto
        drafters.setdefault(builtin, builtin)
    settings = cfg.engine
    if settings.request_k_max is None and cfg.routing.apply_k:  # room for the router's largest K
        fits = [k for k in settings.k_buckets if k <= max(router.k_buckets)]
        settings = dataclasses.replace(settings, request_k_max=max(fits) if fits else None)
    verifier, unavailable = None, ()
    if cfg.role == "draft":  # the same engine, verifying on the target service
        g = cfg.grpc
        verifier = RemoteVerifier(cfg.target_address, timeout_s=g.deadline_s, token=g.resolved_token(),
                                  tls_ca=g.read("tls_ca") if g.tls_ca else None)  # fmt: skip
        unavailable = (TargetUnavailable,)
    loaded = load_engine(
        settings, cfg.target_model or router.target_ref, drafters | {NONE: None},
        default=router.draft_names[0] if router.draft_names else NONE, verifier=verifier,
    )  # fmt: skip
    engine = loaded.engine
    table = router.info.get("step_table")
    if settings.step_k == "goodput" and table:  # the profiled steps price a shape the engine has not timed
        engine.step_costs.set_table(table)
    return loaded.tokenizer, engine, unavailable


def load_models(cfg: ServeConfig) -> LoadedModels:
    """Load the router and the models, build the engine and warm every drafter up."""
    if cfg.router is None:
        raise ValueError(f"role={cfg.role} needs a router: pass --router router.pt (or router=... in the config)")
    router = Router.load(cfg.router, device="cpu")
    # What runs, not "auto": the warnings below, the request log and /metrics name the same precision.
    cfg.engine = cfg.engine.resolved(cfg.target_model or router.target_ref)
    trained_at = router.info.get("target_weights")
    if trained_at is not None and trained_at != cfg.engine.target_weights:
        log.warning("router %s was trained on rows collected with target_weights=%s, and this server runs the target "
                    "at %s: its acceptance and cost predictions describe the other precision", cfg.router, trained_at,
                    cfg.engine.target_weights)  # fmt: skip
    drafts_at, served_at = router.info.get("draft_weights"), cfg.engine.drafts_weights()
    if drafts_at is not None and drafts_at != served_at:
        log.warning("router %s was trained on rows whose drafts ran at draft_weights=%s, and this server runs them at %s: "
                    "its draft cost and acceptance predictions describe the other precision", cfg.router, drafts_at,
                    served_at)  # fmt: skip
    tokenizer, engine, unavailable = load_served_engine(cfg, router)
    target_ref = cfg.target_model or router.target_ref
    # Context kept free for speculation (K + 1): every row of the one engine may draft.
    reserve = engine.config.k_max + 1 if engine.config.k else 1
    if cfg.warmup:
        router.choose("warm up")
        ids = tokenizer.encode("def add(a, b):", add_special_tokens=False)
        for name in engine.drafter_names:  # every drafter once: its first-use costs are paid here
            engine.add_request(Request(ids, max_new_tokens=4, drafter=name))
            while engine.has_unfinished_requests():
                engine.step()
    # A model id, never a filesystem path: /v1/models is public (a folder's name stands for it).
    model_name = cfg.model_name or (Path(target_ref).name if Path(target_ref).exists() else target_ref)
    return LoadedModels(engine, router, load_tokenizer(target_ref), model_name, engine.config.max_len, reserve, unavailable)


class EngineServer:
    """The ``Backend`` (``serving.server.app``) of backend=choral: the models ``load`` loads, the
    scheduler thread that owns the engine, and the request handling on the asyncio side."""

    def __init__(self, cfg: ServeConfig, load: Callable[[ServeConfig], LoadedModels] = load_models) -> None:
        self.cfg = cfg
        self._load_models = load
        self._tokenizing = threading.Lock()
        self.metrics = ServerMetrics()
        self.models: LoadedModels | None = None
        self.scheduler: Scheduler | None = None
        self.ready = False
        self.error: str | None = None
        self.started = int(time.time())
        self.api_key = cfg.resolved_api_key()  # the one key every client sends: it names no client

    @property
    def model_name(self) -> str:
        return self.models.model_name

    def model_info(self) -> dict:
        return {"drafts": list(self.scheduler.drafter_names), "max_len": self.models.max_len}

    async def start(self, on_error: Callable[[BaseException], None] | None) -> None:
        """Load the models on a background thread: /health answers "loading" meanwhile."""
        threading.Thread(target=self._load, args=(on_error,), name="choral-load", daemon=True).start()

    async def stop(self) -> None:
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)

    async def unavailable(self) -> str | None:
        """Why the server cannot answer now (the remote target is down), or None."""
        if not await self._target_up(always_probe=True):
            return f"the target at {self.cfg.target_address} is unavailable"
        return None

    def _load(self, on_error: Callable[[BaseException], None] | None) -> None:
        try:
            t0 = time.perf_counter()
            models = self._load_models(self.cfg)
            request_log = None
            if self.cfg.routing.log_requests is not None:
                request_log = RequestLog(self.cfg.routing.log_requests, target=models.router.target_ref,
                                         target_weights=self.cfg.engine.target_weights, draft_refs=models.router.draft_refs,
                                         draft_weights=self.cfg.engine.drafts_weights())  # fmt: skip
            scheduler = Scheduler(models.engine, models.router, self.metrics, max_batch_size=self.cfg.engine.max_batch_size,
                                  queue_limit=self.cfg.queue_limit, per_client_limit=self.cfg.per_client_limit, unavailable=models.unavailable, routing=self.cfg.routing,
                                  request_log=request_log)  # fmt: skip
            scheduler.start()
            self.token_strings = TokenStrings(models.tokenizer)  # logprobs' token texts and bytes, cached
            self.models, self.scheduler, self.ready = models, scheduler, True
            log.info("choral: ready in %.1f s: model %r, drafters %s", time.perf_counter() - t0, models.model_name,
                     ", ".join(scheduler.drafter_names))  # fmt: skip
        except BaseException as e:
            self.error = f"{type(e).__name__}: {e}"
            log.error("choral: loading failed: %s", self.error)
            if on_error is not None:
                on_error(e)

    async def _target_up(self, always_probe: bool = False) -> bool:
        """Whether the target answers: always in fused mode; on a draft node, what its last call
        saw, asked again (an ``Info`` call, off the event loop) when that failed or ``always_probe``."""
        verifier = getattr(self.models.engine, "verifier", None)
        probe = getattr(verifier, "probe", None)  # a RemoteVerifier's; a local target is always up
        if probe is None or (verifier.available and not always_probe):
            return True
        return await asyncio.to_thread(probe)

    # ---- generation ----------------------------------------------------------------------------

    async def generate(self, http: HTTPRequest, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            if not self.ready:
                self.metrics.requests.labels(endpoint, "503").inc()
                return not_ready(self.error)
            body = parse_request(await read_body(http, self.cfg.max_body_bytes, self.cfg.body_timeout_s),
                                 ChatCompletionRequest if chat else CompletionRequest, TOOL_FIELDS if chat else frozenset())  # fmt: skip
            forced = self._forced_draft(http, body)
            tools = self._tools(body) if chat else None
            if not await self._target_up():  # a stream would start 200 and then fail: answer 503 now
                raise APIError(503, f"the target at {self.cfg.target_address} is unavailable; retry later",
                               code="target_unavailable")  # fmt: skip
            # Tokenizing a long prompt takes seconds: off the event loop, so /health and every
            # stream keep being served meanwhile.
            encoded = await asyncio.to_thread(self._encode_request, body, chat, tools)
            ticket = self._ticket(body, forced, *encoded, tools=tools)
            ticket.client = client_id(http.headers, http.client.host if http.client else None, self.api_key)  # its fair-queue line
            self.scheduler.submit(ticket)
            first = await ticket.events.get()
            if isinstance(first, Failed):
                raise first.error
        except APIError as e:
            self.metrics.requests.labels(endpoint, str(e.status)).inc()
            return json_error(e)
        # Counted when the response ends (_Context.count), with the status the client saw last.
        context = _Context(endpoint, self.metrics, new_id("chatcmpl" if chat else "cmpl"), self.models.model_name, chat, body,
                           len(ticket.request.prompt_ids), first, ticket.forced_draft is not None,
                           ticket.request.params.processors, tools, self.tool_format)  # fmt: skip
        if body.stream:
            return StreamingResponse(self._stream(ticket, context), media_type="text/event-stream")
        return await self._collect(http, ticket, context)

    def _forced_draft(self, http: HTTPRequest, body: Any) -> str | None:
        """The drafter the request forces (body ``draft`` or the X-Choral-Draft header), checked
        with the model name before any tokenizing."""
        check_model(body.model, self.models.model_name)
        return self.scheduler.check_draft(requested_draft(http, body))

    def _encode_request(self, body: Any, chat: bool, tools: Tools | None = None) -> tuple[list[int], str, str, list[int] | None]:
        """(prompt ids, the text the router reads, the field to blame, prediction ids): the
        tokenizer's work, run in a worker thread."""
        with self._tokenizing:  # one at a time: a fast tokenizer may reconfigure itself inside encode
            return *self._encode(body, chat, tools), self._prediction(body)

    @property
    def tool_format(self) -> str:
        return template_format(self.models.tokenizer)

    def _tools(self, body: Any) -> Tools | None:
        """The request's tools, checked (a 400 naming the field), or None without tools."""
        try:
            tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        if tools is not None and tools.choice == "auto" and self.tool_format == NO_FORMAT:
            raise APIError(400, "tool_choice='auto' needs a chat template with a tool-call format, and this model's has "
                           "none: name the function in tool_choice, or send tool_choice='required'", param="tool_choice")  # fmt: skip
        if tools is not None and tools.constrained and body.json_schema[0]:
            raise APIError(400, "response_format and a required or named tool_choice both constrain the answer: send one",
                           param="response_format")  # fmt: skip
        if tools is not None and tools.constrained and self.cfg.role == "draft":
            raise APIError(400, "a required or named tool_choice is not carried to a target service (role=draft); serve "
                           "the target in this process (role fused), or send tool_choice='auto'", param="tool_choice")  # fmt: skip
        return tools

    def _ticket(self, body: Any, forced: str | None, prompt_ids: list[int], route_text: str, param: str,
                prediction: list[int] | None, tools: Tools | None = None) -> Ticket:  # fmt: skip
        b = self.models
        reserve = b.reserve
        if prediction is not None and forced is None and PREDICTION in self.scheduler.drafter_names:
            forced = PREDICTION  # OpenAI's Predicted Outputs: the client's expected text is the draft
        room = b.max_len - len(prompt_ids) - reserve
        if room < 1:
            raise APIError(400, f"{param}: the prompt has {len(prompt_ids)} tokens, more than the context allows: max_len="
                           f"{b.max_len} holds at most {b.max_len - reserve - 1} prompt tokens (plus {reserve} for "
                           "speculation and 1 new token); shorten the prompt", param=param,
                           code="context_length_exceeded")  # fmt: skip
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = min(self.cfg.default_max_tokens, room)
        elif max_tokens > room:
            raise APIError(400, f"max_tokens={max_tokens} is beyond the context: the prompt's {len(prompt_ids)} tokens "
                           f"+ {max_tokens} + {reserve} for speculation exceed max_len={b.max_len}; ask for at most "
                           f"{room}", param="max_tokens", code="context_length_exceeded")  # fmt: skip
        verification = body.verification or self.cfg.verification
        if verification == "threshold" and not self.cfg.allow_lossy:
            raise APIError(400, "verification='threshold' is refused: this server keeps the target's exact output "
                           "(allow_lossy: false); send verification='exact', or start serve with allow_lossy=true",
                           param="verification", code="lossy_not_allowed")  # fmt: skip
        if verification == "threshold" and self.cfg.role == "draft":
            raise APIError(400, "verification='threshold' is not carried to a target service (role=draft); send "
                           "verification='exact'", param="verification")  # fmt: skip
        vocab = len(self.models.tokenizer)
        outside = [k for k in (body.logit_bias or {}) if int(k) >= vocab]
        if outside:
            raise APIError(400, f"logit_bias keys {outside[:5]} are outside the vocabulary: token ids are in [0, {vocab})",
                           param="logit_bias")  # fmt: skip
        try:
            params = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed,
                                    verification=verification,
                                    verification_threshold=body.verification_threshold or self.cfg.verification_threshold,
                                    grammar=self._grammar(body, tools), **body.sampling_fields())  # fmt: skip
        except ValueError as e:  # the request's fields were checked against the same ranges: a guard
            raise sampling_error(e) from None
        if params.processors and self.cfg.role == "draft":
            raise APIError(400, f"{', '.join(params.processors)} are not carried to a target service (role=draft); serve "
                           "the target in this process (role fused) to use them", param=params.processors[0])  # fmt: skip
        request = Request(prompt_ids, params, max_tokens, body.stops, prediction=prediction)
        return Ticket(request, route_text, asyncio.get_running_loop(), forced_draft=forced, stream=body.stream,
                      chat=isinstance(body, ChatCompletionRequest), timeout_s=self.cfg.request_timeout_s)  # fmt: skip

    def _grammar(self, body: Any, tools: Tools | None = None) -> str | None:
        """The llguidance grammar of the request's response_format, or of its required or named
        tool_choice (compiled here, on the event loop, so a schema that cannot compile is the
        client's 400 and never reaches the step)."""
        wanted, schema = body.json_schema
        param = "response_format" if wanted else "tools"
        try:
            grammar = json_schema_grammar(schema) if wanted else (
                tool_grammar(tools, self.tool_format, self.models.tokenizer) if tools is not None else None)  # fmt: skip
            if grammar is not None:
                grammars_for(self.models.tokenizer, self.models.engine.vocab_size).matcher(grammar)  # compiled and cached
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None
        return grammar

    def _longest_token(self) -> int:
        """An upper bound on the characters one token holds: the longest vocabulary entry (a
        byte-level BPE entry has one character per byte, at least as many as it decodes to)."""
        if getattr(self, "_longest", None) is None:
            self._longest = max(map(len, self.models.tokenizer.get_vocab()))
        return self._longest

    def _prediction(self, body: Any) -> list[int] | None:
        """The token ids of a request's ``prediction`` (OpenAI's Predicted Outputs), or None.

        A prediction is a hint, and an answer repeats at most max_len tokens of it: the text is
        cut to what max_len tokens can hold (max_len x the longest vocabulary entry) before it is
        tokenized, and the ids to max_len. Uncut, a 1.9 MB prediction (under the body limit) was
        tokenized whole and indexed by the drafter, held the engine for seconds and grew the
        server by 370 MB a request."""
        if body.prediction is None:
            return None
        max_len = self.models.max_len
        text = body.prediction.text()[: max_len * self._longest_token()]
        return self.models.tokenizer.encode(text, add_special_tokens=False)[:max_len] if text else None

    def _encode(self, body: Any, chat: bool, tools: Tools | None = None) -> tuple[list[int], str, str]:
        """Prompt token ids, the text the router reads, and the field to blame if it is too long.
        A text longer than max_len tokens of the longest token in the vocabulary cannot fit, and
        is refused without being tokenized; so is a stop string no answer could hold (each step
        searches the answer's tail for every stop string)."""
        tok = self.models.tokenizer
        longest = self.models.max_len * self._longest_token()
        too_long = next((i for i, stop in enumerate(body.stops) if len(stop) > longest), None)
        if too_long is not None:
            raise APIError(400, f"stop[{too_long}] is {len(body.stops[too_long]):,} characters: more than max_len="
                           f"{self.models.max_len} tokens can hold, so it can never match; send a shorter stop string",
                           param="stop")  # fmt: skip
        texts = [m.text() for m in body.messages] if chat else [body.prompt] if isinstance(body.prompt, str) else []
        if sum(map(len, texts)) > longest:
            param = "messages" if chat else "prompt"
            raise APIError(400, f"{param}: {sum(map(len, texts))} characters cannot fit in max_len={self.models.max_len} "
                           "tokens; shorten the prompt", param=param, code="context_length_exceeded")  # fmt: skip
        if chat:
            try:
                messages = chat_messages(body.messages)
            except ToolError as e:
                raise APIError(400, str(e), param=e.param) from None
            shown = tools.tools if tools is not None and tools.choice != "none" and self.tool_format == HERMES else None
            try:
                text = tok.apply_chat_template(messages, tools=shown, tokenize=False, add_generation_prompt=True)
            except Exception as e:
                raise APIError(400, f"messages could not be rendered with the chat template: {e}", param="messages") from None
            users = [m["content"] for m in messages if m["role"] == "user"]
            return tok.encode(text, add_special_tokens=False), users[-1] if users else messages[-1]["content"], "messages"
        if isinstance(body.prompt, str):
            return tok.encode(body.prompt, add_special_tokens=False), body.prompt, "prompt"
        bad = [i for i in body.prompt if not 0 <= i < len(tok)]
        if bad:
            raise APIError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {len(tok)})", param="prompt")
        return list(body.prompt), tok.decode(body.prompt, skip_special_tokens=True), "prompt"

    async def _collect(self, http: HTTPRequest, ticket: Ticket, c: "_Context") -> Response:
        disconnect = asyncio.create_task(wait_disconnect(http))
        get = asyncio.create_task(ticket.events.get())
        try:
            done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                self.scheduler.abort(ticket)
                c.count(499)
                return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
            event = get.result()
        except asyncio.CancelledError:  # the handler itself was cancelled (shutdown, client gone): free the slot
            if not ticket.done:
                self.scheduler.abort(ticket)
            c.count(499)
            raise
        finally:
            get.cancel()
            disconnect.cancel()
        if isinstance(event, Failed):
            c.count(event.error.status)
            return JSONResponse(event.error.body(), status_code=event.error.status)
        c.count(200)
        out = event.completion
        logprobs = None
        if c.body.logprob_count is not None and out.logprobs is not None:
            if c.chat:
                logprobs = chat_logprobs(out.logprobs, self.token_strings)
            else:  # text_offset: where each token's text starts, as a stream releases it
                texts = token_texts(self.models.tokenizer, c.body.stops, out.token_ids, out.text)
                logprobs = completion_logprobs(out.logprobs, self.token_strings, text_offsets(texts))
        content, calls = c.answer(out.text)
        body = completion_body(c.id, c.model, content, finish_reason(out.finish_reason, c.tools, calls),
                               usage(c.prompt_tokens, len(out.token_ids)), c.choral(out.stats), c.chat, logprobs, calls)  # fmt: skip
        return JSONResponse(body)

    async def _stream(self, ticket: Ticket, c: "_Context") -> AsyncIterator[bytes]:
        detok = IncrementalDetokenizer(self.models.tokenizer, c.body.stops)
        created = int(time.time())

        sent = 0  # characters of the answer's text sent so far (completions' text_offset counts from 0)

        def chunk(**kw: Any) -> bytes:
            nonlocal sent
            sent += len(kw.get("text") or "")
            return sse(chunk_body(c.id, c.model, created, c.chat, **kw))

        pending: list[dict] = []  # the tokens whose text has not gone out yet, in order
        pending_lp: list = []  # their TokenLogprob entries (when asked for and the engine gave them)
        wants_logprobs = c.body.logprob_count is not None

        def push(ids: list[int], origins: list | None, logprobs: list | None = None) -> None:
            """Detokenize one token at a time, so each token's entry holds the text it released."""
            for i, token in enumerate(ids):
                origin = origins[i].to_dict() if origins else {"origin": None, "drafter": None}
                pending.append({"id": token, "text": detok.push([token])} | origin)
                pending_lp.append(logprobs[i] if logprobs else None)

        def chunk_logprobs(entries: list[dict]) -> dict | None:
            """The logprobs of the tokens whose text a chunk carries (``entries``: their choral.tokens)."""
            if not wants_logprobs or not entries or any(lp is None for lp in pending_lp):
                return None
            if c.chat:
                return chat_logprobs(pending_lp, self.token_strings)
            return completion_logprobs(pending_lp, self.token_strings, text_offsets([e["text"] for e in entries], sent))

        holding = c.holds("")  # text that may begin a tool call waits for the end (``_Context.holds``)
        streamed = ""  # the content sent so far
        try:
            if c.chat:
                yield chunk(role=True, text="")
            while True:
                event = await ticket.events.get()
                if isinstance(event, Tokens):
                    push(event.ids, event.origins, event.logprobs)
                    delta = "".join(e["text"] for e in pending)
                    holding = c.holds(streamed + delta)  # recomputed: a fence that is not a call goes out
                    if delta and not holding:
                        logprobs = chunk_logprobs(pending)
                        yield chunk(text=delta, choral={"tokens": pending}, logprobs=logprobs)
                        streamed += delta
                        pending, pending_lp = [], []
                elif isinstance(event, Finished):
                    c.count(200)
                    out = event.completion
                    rest = detok.finish(out.text)  # what is left of the final text, stop strings cut
                    seen = len(detok.ids)
                    push(out.token_ids[seen:], out.origins[seen:] if out.origins else None,
                         out.logprobs[seen:] if out.logprobs else None)  # fmt: skip
                    n_usage = usage(c.prompt_tokens, len(out.token_ids))
                    content, calls = c.answer(out.text)
                    holding = holding or bool(calls)
                    tokens = fit_texts(pending, out.text[len(streamed):] if holding else rest)  # the unsent tokens' texts
                    logprobs = chunk_logprobs(tokens)
                    if holding:  # what the held text holds: the rest of the content, and the calls
                        rest = (content or "")[len(streamed):]
                    yield chunk(text=rest if rest or not c.chat else None, tool_calls=calls,
                                finish_reason=finish_reason(out.finish_reason, c.tools, calls),
                                choral=c.choral(out.stats) | {"tokens": tokens}, logprobs=logprobs)  # fmt: skip
                    if c.body.include_usage:
                        yield chunk(usage=n_usage)
                    yield sse("[DONE]")
                    return
                elif isinstance(event, Failed):
                    # The stream began with HTTP 200; the client's answer is this error event.
                    c.count(event.error.status)
                    yield sse(event.error.body())
                    yield sse("[DONE]")
                    return
        finally:
            if not ticket.done:  # the client went away (or the server is stopping): free the slot
                self.scheduler.abort(ticket)
            c.count(499)  # no-op once counted


@dataclass
class _Context:
    endpoint: str
    metrics: Any
    id: str
    model: str
    chat: bool
    body: Any
    prompt_tokens: int
    routed: Routed
    forced: bool
    processors: tuple[str, ...] = ()  # the request's logits processors (SamplingParams.processors)
    tools: Tools | None = None  # the request's tools (serving.server.tools)
    tool_format: str = NO_FORMAT  # the chat template's tool-call format
    counted: bool = False

    @property
    def calling(self) -> bool:
        """Whether the answer may hold tool calls (a stream then holds back text that may be one)."""
        return self.tools is not None and self.tools.choice != "none"

    def holds(self, text: str) -> bool:
        """Whether a stream holds back what it has of the answer (``text``): with tools, from where a
        call may begin (a template without a tool format answers a required or named choice in JSON
        alone: all of it); the end parses it into content and tool_calls, as a whole answer is."""
        return self.calling and (self.tool_format == NO_FORMAT or may_open(text) < len(text))

    def answer(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of the answer's text."""
        if not self.calling:
            return text, []
        return parse_calls(text, self.tools, self.tool_format)

    def count(self, status: int) -> None:
        """Count this request in ``choral_requests_total`` once, when its response ends."""
        if not self.counted:
            self.counted = True
            self.metrics.requests.labels(self.endpoint, str(status)).inc()

    def choral(self, stats: dict) -> dict:
        """The extra response field: what speculation did for this request."""
        choice = self.routed.choice
        draft = self.routed.draft
        return {
            "draft": draft,
            "forced": self.forced,
            "acceptance_rate": stats.get("acceptance_rate", 0.0),
            "tokens_per_target_call": stats.get("mean_accepted_length", 0.0),
            "target_calls": stats.get("target_calls", 0),
            # The drafters whose proposals its steps verified, as shares of its steps (auto mixes them).
            "drafter_shares": stats.get("drafter_shares", {}),
            # Where the request's time went: the prompt's prefill, then the draft and verify steps.
            "prefill_s": stats.get("prefill_time_s", 0.0),
            "draft_s": stats.get("draft_time_s", 0.0),
            "verify_s": stats.get("target_time_s", 0.0),
            "predicted_acceptance": choice.predicted_acceptance.get(draft) if choice else None,
            "predicted_speedup": choice.predicted_speedup.get(draft) if choice else None,
            "suggested_k": choice.k if choice and not self.routed.explored else None,  # for the router's own drafter
            "k": self.routed.k if self.routed.k is not None else round(stats.get("mean_k", 0.0), 2),  # router's K, or engine's mean
            # Why K was lower than asked: steps the engine capped it for the batch's load (engine.step_k goodput).
            "load_capped_steps": stats.get("capped_steps", 0),
            "occupancy": choice.occupancy if choice else None,  # the batch the router chose for
            "router_choice": choice.draft if choice else None,
            "explored": self.routed.explored,  # routing.explore drew another drafter than router_choice
            "fallback": stats.get("fallback"),  # {"to": "none", "at_token": n} when the drafter stopped paying
            "exact": stats.get("exact", True),  # false: threshold verification, the output may not be the target's
            "processors": list(self.processors),  # the logits processors it used: logit_bias, min_p, penalties
        }
