"""Fair admission: who gets the engine's next free slot, and who is refused at the door.

A request that cannot start at once waits here, in its client's own line, not in one shared
first-come line: a client that sends 300 streams at once would otherwise fill every slot and
every place in the queue, and every other client would wait behind it or get 429s until those
finish. The next free slot goes to the oldest request of the client with the fewest requests
running (ties: the client served least recently), so a newcomer runs as soon as a slot
frees whatever another client has queued. A client holds at most ``per_client_limit`` requests
running and waiting (``serve.per_client_limit``), and all clients together at most
``queue_limit`` waiting (``serve.queue_limit``); past either the request gets a 429 naming it.

A client is its API key where it sends its own (a gateway forwarding each user's key), else its
peer address (``client_id``). Running requests are never preempted: fairness acts on the next free
slot, and the limit bounds how many a client can hold when others arrive.
"""

from __future__ import annotations

import hashlib
from collections import deque
from typing import Any, Iterator


def client_id(headers: Any, peer: str | None, server_key: str | None) -> str:
    """Who sent a request: ``key:<sha256 prefix>`` of its bearer key when that is its own (not the
    server's one ``api_key``, which every client sends), else ``addr:<peer host>``."""
    given = headers.get("authorization", "")
    key = given[7:].strip() if given[:7].lower() == "bearer " else ""
    if key and key != server_key:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:12]  # never the key itself: it names the client in 429s
    return f"addr:{peer or 'unknown'}"


class FairQueue:
    """Waiting requests (anything with a ``client`` attribute), one line per client, and how many
    each client has running. Used from the scheduler thread only."""

    def __init__(self, queue_limit: int, per_client_limit: int) -> None:
        self.queue_limit, self.per_client_limit = queue_limit, per_client_limit
        self._lines: dict[str, deque] = {}  # client -> its waiting requests, oldest first
        self._running: dict[str, int] = {}
        self._served: dict[str, int] = {}  # client -> when its request last started (a count of pops)
        self._size = 0
        self._clock = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Any]:
        for line in list(self._lines.values()):
            yield from list(line)

    def held(self, client: str) -> int:
        """The client's requests running and waiting."""
        return self._running.get(client, 0) + len(self._lines.get(client, ()))

    def refusal(self, client: str, free: int = 0) -> tuple[str, str] | None:
        """Why a new request of ``client`` is refused, as a 429's (code, message), or None when it
        may wait (``free``: the engine's free slots, which it takes at once whatever the queue holds)."""
        if self.held(client) >= self.per_client_limit:
            return "rate_limit_exceeded", (f"client {client} already has {self.held(client)} requests running or waiting "
                                           f"(per_client_limit={self.per_client_limit}); wait for one to finish, or raise "
                                           "serve.per_client_limit")  # fmt: skip
        if self._size >= self.queue_limit + max(0, free):
            return "queue_full", (f"the server is full: {self._size} requests are already waiting for a slot (queue_limit="
                                  f"{self.queue_limit}); retry later")  # fmt: skip
        return None

    def push(self, item: Any) -> None:
        self._lines.setdefault(item.client, deque()).append(item)
        self._size += 1

    def pop(self) -> Any | None:
        """The next request to start: the oldest of the client with the fewest running; None when
        none waits. Its client counts it as running from here (``ended`` when it ends)."""
        if not self._lines:
            return None
        # Fewest running first; on a tie the client served least recently (never: first), then the older line.
        client = min(self._lines, key=lambda c: (self._running.get(c, 0), self._served.get(c, -1)))
        line = self._lines[client]
        item = line.popleft()
        if not line:
            del self._lines[client]
        self._size -= 1
        self._running[client] = self._running.get(client, 0) + 1
        self._clock += 1
        self._served[client] = self._clock
        return item

    def remove(self, item: Any) -> bool:
        """Take a waiting request out (cancelled, timed out); False if it was not waiting."""
        line = self._lines.get(item.client)
        if line is None or item not in line:
            return False
        line.remove(item)
        if not line:
            del self._lines[item.client]
        self._size -= 1
        return True

    def ended(self, item: Any) -> None:
        """A request ``pop`` started has ended (finished, failed, cancelled)."""
        left = self._running.get(item.client, 0) - 1
        if left > 0:
            self._running[item.client] = left
        else:
            self._running.pop(item.client, None)
            if item.client not in self._lines:
                self._served.pop(item.client, None)  # it holds nothing: forget it (clients come and go)
