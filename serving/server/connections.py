"""The HTTP server's connections: uvicorn, with a deadline for the first request.

uvicorn closes a keep-alive connection idle after an answer (``timeout_keep_alive``), but a
connection that never sends a request has no deadline: 1,000 such sockets stay open forever, each
holding a file descriptor and a slot of ``limit_concurrency``. ``uvicorn_config`` arms uvicorn's own
keep-alive timer as the connection opens too, so a connection that sends nothing within
``idle_timeout_s`` is closed the same way (the first byte of a request disarms it, as it does
after an answer), and caps open connections with ``limit_concurrency`` (``max_connections``):
past it uvicorn answers 503.
"""

from __future__ import annotations

from typing import Any


def uvicorn_config(app: Any, cfg: Any, **overrides: Any) -> Any:
    """``uvicorn.Config`` for ``app`` from a ``ServeConfig`` (host, port, log level, the idle
    deadline, the connection cap); ``overrides`` replace any of uvicorn's arguments."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol  # httptools where installed, else h11: uvicorn's own pick

    kwargs = {"host": cfg.host, "port": cfg.port, "log_level": cfg.log_level, "timeout_keep_alive": cfg.idle_timeout_s,
              "limit_concurrency": cfg.max_connections, "http": deadline_protocol(AutoHTTPProtocol)} | overrides  # fmt: skip
    return uvicorn.Config(app, **kwargs)


def deadline_protocol(base: type) -> type:
    """``base`` (uvicorn's h11 or httptools protocol) with its keep-alive timer armed at
    ``connection_made``: a connection idle from the start is closed after ``timeout_keep_alive``."""

    class FirstRequestDeadline(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    FirstRequestDeadline.__qualname__ = f"FirstRequestDeadline[{base.__name__}]"
    return FirstRequestDeadline
