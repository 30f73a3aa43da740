"""The HTTP helpers both backends use (the Choral engine's ``server`` and the vLLM fleet front):
reading a request body within its limits, noticing a client that went away, the model and draft a
request names, and OpenAI-style error responses."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from serving.server.openai_api import APIError

log = logging.getLogger("choral.server")

DRAFT_HEADER = "x-choral-draft"  # forces a drafter, as the body's ``draft`` field does


async def read_body(http: HTTPRequest, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body, refused with 413 past ``max_body_bytes`` before any of it is parsed.
    The rest of an oversized body is read and dropped (up to 16x the limit), as nginx does, so
    the client gets to read the 413 instead of a connection reset mid-upload.

    A body still arriving after ``timeout_s`` (``body_timeout_s``) is cut off with a 408: uvicorn
    closes idle connections but has no deadline for a body that trickles in a byte at a time. A
    client that disconnects before its body is read gets a 499 (nginx's "client closed request",
    which no client receives): counted under its own label and logged at INFO, not a 500."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in http.stream():
                size += len(chunk)
                if size <= limit:
                    chunks.append(chunk)
                elif size > 16 * limit:
                    break
    except ClientDisconnect:
        log.info("%s %s: the client closed the connection after %d bytes of its request body (499)",
                 http.method, http.url.path, size)  # fmt: skip
        raise APIError(499, "the client closed the connection before its request was read",
                       code="client_closed_request") from None  # fmt: skip
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within body_timeout_s={timeout_s:g} s ({size} bytes "
                       "came); send the whole body at once (or raise body_timeout_s in the server's config)",
                       code="request_timeout") from None  # fmt: skip
    if size > limit:
        raise APIError(413, f"the request body is larger than max_body_bytes={limit}; send a shorter prompt (or "
                            "raise max_body_bytes in the server's config)", code="request_too_large")  # fmt: skip
    return b"".join(chunks)


async def wait_disconnect(http: HTTPRequest) -> None:
    """Returns once the client has gone away (the body is already read, so the next ASGI
    message is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def check_model(requested: str, served: str) -> None:
    """Refuse (404) a request for another model than the one this server serves."""
    if requested != served:
        raise APIError(404, f"model {requested!r} does not exist; this server serves {served!r}", param="model",
                       code="model_not_found")  # fmt: skip


def requested_draft(http: HTTPRequest, body: Any) -> str | None:
    """The drafter a request forces: the body's ``draft`` field, else the X-Choral-Draft header,
    else None (the router chooses). The backend checks the name against what it serves."""
    return body.draft if body.draft is not None else http.headers.get(DRAFT_HEADER)


def json_error(error: APIError) -> JSONResponse:
    """An ``APIError`` as OpenAI's error body, with its status and headers."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def not_ready(error: str | None) -> JSONResponse:
    """503 while the backend loads, or for good once loading failed (naming why)."""
    why = f"loading failed: {error}" if error else "the server is still loading; retry when /health is 200"
    return JSONResponse(APIError(503, why, code="not_ready").body(), status_code=503)
