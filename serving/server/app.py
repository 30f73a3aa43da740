"""The FastAPI app of ``serve``: OpenAI's routes over a ``Backend``.

    app = create_app(EngineServer(cfg), cfg)    # backend=choral: the engine in this process
    app = create_app(FleetServer(cfg), cfg)     # backend=vllm: a front over pools of vLLM replicas
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints:

* ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI's request and response
  formats, streamed as server-sent events with ``stream: true``. Each response carries an extra
  ``choral`` object (what speculation did for it); OpenAI clients ignore it. A ``draft`` body
  field or an ``X-Choral-Draft`` header forces a drafter (``none``: the target alone).
* ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

The app owns what is the same for both backends: the API key (vLLM's ``--api-key``), error bodies
for every status Starlette answers itself, ``/health`` and ``/v1/models`` from the backend's state,
and ``/metrics``. The backend owns loading and generation. ``Backend`` writes down what the app
calls; ``server.EngineServer`` and ``vllm_backend.FleetServer`` implement it.
"""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HTTPRequest

from serving.server.http import not_ready
from serving.server.metrics import CONTENT_TYPE, ServerMetrics
from serving.server.openai_api import APIError
from serving.server.serve_config import ServeConfig

log = logging.getLogger("choral.server")

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}  # path -> metrics label
OPEN_PATHS = {"/health", "/metrics"}  # served without the API key (probes and scrapers), as vLLM does


class Backend(Protocol):
    """What the app serves: one model, loaded in the background, generating for HTTP requests.
    Like vLLM's ``EngineClient`` for its API server: the app never sees what is behind it."""

    metrics: ServerMetrics  # the backend's Prometheus registry: /metrics renders it; the app counts its own answers in it
    started: int  # when the backend was made (Unix seconds): /v1/models' ``created``

    @property
    def ready(self) -> bool:
        """Whether requests can be served now: loaded (and, for the fleet, a replica is usable)."""

    @property
    def error(self) -> str | None:
        """Why the backend cannot serve (loading failed, no replica is usable), or None."""

    @property
    def model_name(self) -> str:
        """The model id requests name and /v1/models lists (never a filesystem path). Read once ready."""

    def model_info(self) -> dict:
        """The ``choral`` object of /v1/models' entry: the drafts, or the fleet's pools. Read once ready."""

    async def start(self, on_error: Callable[[BaseException], None] | None) -> None:
        """Begin loading without blocking the event loop (/health answers "loading" meanwhile);
        ``on_error`` is called with the exception if loading fails."""

    async def stop(self) -> None:
        """Stop serving: the scheduler thread, or the replica watcher and the HTTP client."""

    async def unavailable(self) -> str | None:
        """Once ready: why it cannot answer now (the remote target or every replica is down), or None."""

    async def generate(self, http: HTTPRequest, chat: bool) -> Response:
        """Answer one completion (``chat``: chat completion) request, streamed or whole, errors
        included as OpenAI error bodies; counts it in ``metrics.requests``."""


def create_app(backend: Backend, cfg: ServeConfig, on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The FastAPI app over ``backend``; it starts loading when the app starts (``on_load_error``
    hears of a failure). ``cfg``: the API key and whether the interactive docs are served."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.start(on_load_error)
        yield
        await backend.stop()

    # The interactive docs expose every route and schema to whoever can reach the port: off unless asked for.
    docs = {} if cfg.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Choral", lifespan=lifespan, **docs)
    app.state.backend = backend
    _guard(app, backend, cfg.resolved_api_key())
    _routes(app, backend)
    return app


def _count(backend: Backend, path: str, status: int) -> None:
    """Count an answer the app gives itself to a generation route (401, 500) in choral_requests_total."""
    if path in ENDPOINTS:
        backend.metrics.requests.labels(ENDPOINTS[path], str(status)).inc()


def _guard(app: FastAPI, backend: Backend, api_key: str | None) -> None:
    """The API key check and the error bodies of what the routes do not answer themselves."""

    @app.middleware("http")
    async def check_api_key(request: HTTPRequest, call_next):
        """vLLM's --api-key: every route but /health and /metrics needs ``Authorization: Bearer KEY``."""
        if api_key is not None and request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                _count(backend, request.url.path, 401)
                error = APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' (the "
                                      "openai client's api_key)", code="invalid_api_key")  # fmt: skip
                return JSONResponse(error.body(), status_code=401)
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        # Starlette's 405 carries the Allow header the client needs; keep every header it set.
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: HTTPRequest, exc: Exception) -> JSONResponse:
        log.exception("choral: %s %s failed", request.method, request.url.path)
        _count(backend, request.url.path, 500)  # every answered request is counted once, this one too
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(error.body(), status_code=500)


def _routes(app: FastAPI, backend: Backend) -> None:
    @app.post("/v1/completions")
    async def completions(request: HTTPRequest) -> Response:
        return await backend.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest) -> Response:
        return await backend.generate(request, chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        if not backend.ready:
            return not_ready(backend.error)
        entry = {"id": backend.model_name, "object": "model", "created": backend.started, "owned_by": "choral",
                 "choral": backend.model_info()}  # fmt: skip
        return JSONResponse({"object": "list", "data": [entry]})

    @app.get("/health")
    async def health() -> Response:
        if backend.ready:
            down = await backend.unavailable()
            if down is not None:
                return JSONResponse({"status": "error", "error": down}, status_code=503)
            return JSONResponse({"status": "ok"})
        if backend.error is not None:
            return JSONResponse({"status": "error", "error": backend.error}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(backend.metrics.render(), media_type=CONTENT_TYPE)
