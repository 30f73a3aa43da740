"""Suffix decoding (Oliaro et al. 2024, arXiv 2411.04975; Arctic Inference, vLLM/SGLang method ``suffix``).

Structure. A *depth-limited suffix trie* stores every substring of up to ``max_depth`` tokens of a token
sequence as a root path; a node's ``count`` is how many times its string occurs, and ``total`` (the sum of its
children's counts) how many of those occurrences are followed by another token. Appending a token extends
the nodes of the sequence's current suffixes of length 0..max_depth-1 (kept in an "active" list) by one
child each: O(max_depth) per token, at most max_depth nodes per token of memory. Each request gets its own
trie over prompt + generated tokens; finished requests' outputs (prompt excluded) go into one global trie,
FIFO-bounded to ``max_cached_requests`` outputs, whose eviction replays the output with decrements.

Proposal. The longest suffix of the request's context that occurs earlier with a continuation is matched in
both tries; from its node the most frequent child is followed greedily, each step's empirical probability
being child.count / node.total and a token's confidence the running product. The walk stops at ``k``
tokens, at ``max_spec_factor * match_length`` tokens, at the trie depth, or before a token whose confidence
would fall below ``min_token_prob``. The source whose proposal has the higher score (sum of confidences,
Arctic's "expected accepted tokens") wins; the request's own trie wins ties.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Hashable, Sequence

from serving.engine.drafters.base import HostDrafter, RowContext

_TOKEN_BITS = 31  # edge key = (parent << 31) | token, so token ids must lie in [0, 2**31)


class _Trie:
    """Depth-limited suffix trie kept in flat arrays: a node is an index, one int-keyed dict holds every edge.

    Why not a node object per trie node: a 2k-token prompt makes ~max_depth * 2k nodes and a global cache
    millions; as objects they are all tracked by the cyclic GC, whose full collections then dominate insert
    time (measured ~4x). Arrays of ints and a dict of int -> int are a handful of objects to the GC.

    Per node (index): ``tok`` its token, ``count`` the occurrences of its root path, ``total`` how many of
    those are followed by another token (== sum of the children's counts), ``best`` the most frequent child
    (ties: the most recently incremented, by ``stamp``; -1 when childless or stale after an eviction),
    and, when ``links`` (the global trie, which evicts), a doubly linked sibling list (``first``/``nxt``/
    ``prv``) so a stale ``best`` can be recomputed and a dead child unlinked in O(1).
    """

    __slots__ = ("best", "clock", "count", "edges", "first", "free", "links", "max_depth", "nxt", "prv", "stamp",
                 "tok", "total")

    def __init__(self, max_depth: int, links: bool) -> None:
        self.max_depth = max_depth
        self.links = links
        self.edges: dict[int, int] = {}
        self.tok = array("i", [-1])
        self.count = array("i", [0])
        self.total = array("i", [0])
        self.best = array("i", [-1])
        self.stamp = array("q", [0])
        self.first = array("i", [-1] if links else [])
        self.nxt = array("i", [-1] if links else [])
        self.prv = array("i", [-1] if links else [])
        self.free: list[int] = []
        self.clock = 0

    def __len__(self) -> int:
        """Live nodes, root included."""
        return len(self.count) - len(self.free)

    def extend(self, active: list[int], tokens: Sequence[int]) -> list[int]:
        """Insert the suffixes ending at each new token; O(max_depth) per token. Returns the new active list.

        ``active[j]`` is the node of the sequence's suffix of length j (``active[0]`` is the root, 0), for
        j < min(len(sequence) + 1, max_depth).
        """
        edges, tok_a, count, total, best, stamp = self.edges, self.tok, self.count, self.total, self.best, self.stamp
        first, nxt, prv, free = self.first, self.nxt, self.prv, self.free
        max_depth, links, clock = self.max_depth, self.links, self.clock
        for tok in tokens:
            clock += 1
            new_active = [0]
            for node in active:
                key = (node << _TOKEN_BITS) | tok
                child = edges.get(key)
                if child is None:
                    # Inline rather than a method: most tokens of a fresh sequence create ~max_depth nodes.
                    if free:
                        child = free.pop()
                        tok_a[child], count[child], total[child], best[child] = tok, 0, 0, -1
                    else:
                        child = len(count)
                        tok_a.append(tok)
                        count.append(0)
                        total.append(0)
                        best.append(-1)
                        stamp.append(0)
                        if links:
                            first.append(-1)
                            nxt.append(-1)
                            prv.append(-1)
                    if links:  # push to the front of the parent's sibling list
                        head = first[node]
                        first[child], prv[child], nxt[child] = -1, -1, head
                        if head >= 0:
                            prv[head] = child
                        first[node] = child
                    edges[key] = child
                count[child] += 1
                stamp[child] = clock
                total[node] += 1
                b = best[node]
                if b < 0:
                    # Without a scan, only safe when this child holds all of the node's continuations.
                    if count[child] == total[node]:
                        best[node] = child
                elif b != child and count[child] >= count[b]:
                    best[node] = child
                new_active.append(child)
            if len(new_active) > max_depth:
                new_active.pop()  # the depth-max_depth node: counted, never extended
            active = new_active
        self.clock = clock
        return active

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo :meth:`extend` of a whole sequence: O(max_depth) per token. Needs ``links``."""
        edges, count, total, best, first, nxt, prv = (self.edges, self.count, self.total, self.best, self.first,
                                                      self.nxt, self.prv)
        n = len(tokens)
        for start in range(n):
            node = 0
            for j in range(start, min(start + self.max_depth, n)):
                key = (node << _TOKEN_BITS) | tokens[j]
                child = edges[key]  # present: this substring was inserted
                count[child] -= 1
                total[node] -= 1
                if best[node] == child:
                    best[node] = -1
                if count[child] == 0:
                    # Its descendants can only hold occurrences starting at `start`, which this loop removes
                    # next, so the id is free for reuse once the loop is done with it.
                    del edges[key]
                    p, q = prv[child], nxt[child]
                    if p >= 0:
                        nxt[p] = q
                    else:
                        first[node] = q
                    if q >= 0:
                        prv[q] = p
                    self.free.append(child)
                node = child

    def best_child(self, node: int) -> int:
        b = self.best[node]
        if b < 0:
            # Only after an eviction decremented the previous best: O(children) once, then cached.
            count, stamp, child = self.count, self.stamp, self.first[node]
            while child >= 0:
                if b < 0 or (count[child], stamp[child]) > (count[b], stamp[b]):
                    b = child
                child = self.nxt[child]
            self.best[node] = b
        return b

    def walk(self, node: int, budget: int, min_token_prob: float) -> tuple[list[int], list[float]]:
        """Greedy most-frequent path below ``node``: O(budget) (plus a one-off child scan after an eviction)."""
        tokens: list[int] = []
        probs: list[float] = []
        prob = 1.0
        count, total = self.count, self.total
        while len(tokens) < budget and total[node] > 0:
            child = self.best_child(node)
            p = prob * count[child] / total[node]
            if p < min_token_prob:
                break
            prob = p
            tokens.append(self.tok[child])
            probs.append(p)
            node = child
        return tokens, probs

    def descend(self, pattern: Sequence[int]) -> int:
        """The node of ``pattern`` (a root path), or -1: O(len(pattern))."""
        node, edges = 0, self.edges
        for tok in pattern:
            node = edges.get((node << _TOKEN_BITS) | tok, -1)
            if node < 0:
                return -1
        return node

    def snapshot(self) -> dict[tuple[int, ...], tuple[int, int]]:
        """Every live node's (count, total) by root path; O(nodes), for tests and debugging."""
        children: dict[int, list[int]] = {}
        for key, child in self.edges.items():
            children.setdefault(key >> _TOKEN_BITS, []).append(child)
        out: dict[tuple[int, ...], tuple[int, int]] = {}
        stack: list[tuple[tuple[int, ...], int]] = [((), 0)]
        while stack:
            path, node = stack.pop()
            if path:
                out[path] = (self.count[node], self.total[node])
            stack.extend((path + (self.tok[c],), c) for c in children.get(node, ()))
        return out


def _tokens(tokens: Sequence[int]) -> list[int]:
    toks = [int(t) for t in tokens]
    if toks and (min(toks) < 0 or max(toks) >> _TOKEN_BITS):
        bad = min(toks) if min(toks) < 0 else max(toks)
        raise ValueError(f"token id {bad} is out of range: token ids must lie in [0, 2**{_TOKEN_BITS})")
    return toks


class _Request:
    __slots__ = ("active", "private", "prompt_len", "tokens", "trie")

    def __init__(self, max_depth: int, prompt_len: int, private: bool) -> None:
        self.tokens: list[int] = []
        self.prompt_len = prompt_len
        self.private = private
        self.trie = _Trie(max_depth, links=False)  # never evicts: no sibling lists needed
        self.active = [0]


class SuffixCache:
    """Suffix-decoding drafter: per-request suffix tries plus a global FIFO cache of finished outputs.

    Options mirror vLLM's ``SpeculativeConfig.suffix_decoding_*`` (and Arctic Inference's ``suffix_*``):

    Args:
        max_depth: the tries' depth, i.e. the longest substring stored (vLLM ``suffix_decoding_max_tree_depth``,
            default 24 as there). It bounds match length + proposal length together, and memory per token.
            At least 2 (one token matched, one proposed).
        max_cached_requests: how many finished outputs the global trie keeps, oldest evicted first (vLLM
            ``suffix_decoding_max_cached_requests``; 0 disables the global cache, the request's own trie is
            still used). The default 256 is far below vLLM's 10000 because memory here is ~2 KB per cached
            token at the default depth (~15 nodes per token of ~140 bytes on varied text): 256 outputs of 500
            tokens measured ~2M nodes, ~280 MB. Repetitive outputs share nodes and cost less.
        min_token_prob: a token is proposed only while the running product of step frequencies stays
            >= this (vLLM ``suffix_decoding_min_token_prob``, default 0.1). 0 disables the cut.
        max_spec_factor: at most ``floor(max_spec_factor * match_length)`` tokens are proposed (vLLM
            ``suffix_decoding_max_spec_factor``, default 1.0): short matches are weak evidence.

    Choices that differ from Arctic Inference, and why:

    * Step probability is ``child.count / node.total`` (occurrences *followed by a token*), not
      ``/ node.count``: the request's own trie always holds the context's trailing occurrence, which has no
      continuation yet, and counting it would halve a once-seen continuation's probability in the own trie
      only, biasing the own-vs-global choice against the request's own text.
    * One match length per trie instead of a score search over every length (O(max_depth * (max_depth + k))):
      the longest matching suffix, shortened only as far as needed to leave trie depth for the proposal
      (largest m maximising ``min(k, floor(max_spec_factor * m), max_depth - m)``).
    * Outputs join the global trie at :meth:`stop_request`, not while generating.

    Ties between children of equal count go to the most recently incremented one (the text seen last), so
    proposals are deterministic functions of the calls made.

    Costs (D = max_depth): inserting a token O(D); :meth:`propose` O(D + k) for the own trie and
    O(D log D + k) for the global trie (a binary search over match lengths, each probe a root descent);
    a proposal through a node whose best child was decremented by an eviction rescans its children once.
    Memory: at most D nodes per token held (prompt + generated per active request, outputs in the cache).
    """

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 256, min_token_prob: float = 0.1,
                 max_spec_factor: float = 1.0) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth={max_depth} is too small: pass max_depth >= 2 (one token matched, one proposed)")
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests={max_cached_requests} is negative: pass >= 0 (0 disables the "
                             "global cache of finished outputs)")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob={min_token_prob} is not a probability: pass a value in [0, 1]")
        if max_spec_factor < 0:
            raise ValueError(f"max_spec_factor={max_spec_factor} is negative: pass >= 0 (proposal length is at "
                             "most max_spec_factor * match length)")
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.min_token_prob = min_token_prob
        self.max_spec_factor = max_spec_factor
        self._requests: dict[Hashable, _Request] = {}
        self._global = _Trie(max_depth, links=True)
        self._cached: deque[tuple[Hashable, list[int]]] = deque()
        self._caps: dict[int, int] = {}  # k -> _match_cap(k); the options are fixed after __init__

    # -- lifecycle ---------------------------------------------------------------------------------------

    @property
    def active_requests(self) -> list[Hashable]:
        """Ids started and not yet stopped, in start order."""
        return list(self._requests)

    @property
    def cached_requests(self) -> list[Hashable]:
        """Ids whose outputs are in the global cache, oldest (next evicted) first."""
        return [req_id for req_id, _ in self._cached]

    def _get(self, req_id: Hashable) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise ValueError(f"request {req_id!r} is not active: call start_request({req_id!r}, prompt) first")
        return req

    def start_request(self, req_id: Hashable, prompt: Sequence[int], *, private: bool = False) -> None:
        """Build the request's own suffix trie over its prompt (O(D) per prompt token).

        ``private``: the request neither drafts from the global cache nor adds its output to it (a seeded
        sampled request: its random draws depend on what was proposed, so drafting from other requests'
        outputs would make it irreproducible; keeping its output out too is the conservative half).
        """
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} is already active: stop_request({req_id!r}) before reusing the id")
        req = _Request(self.max_depth, len(prompt), private)
        self._requests[req_id] = req
        self.add_tokens(req_id, prompt)

    def add_tokens(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        """Append tokens (each step's accepted tokens) to the request's context and its own trie."""
        req = self._get(req_id)
        toks = _tokens(tokens)
        req.tokens.extend(toks)
        req.active = req.trie.extend(req.active, toks)

    def stop_request(self, req_id: Hashable) -> None:
        """Free the request's trie; its generated output (prompt excluded) joins the global cache.

        An empty output (or a private request's) takes no cache slot. Beyond ``max_cached_requests`` outputs the oldest are evicted,
        their counts decremented and emptied nodes removed (O(D) per evicted token).
        """
        req = self._get(req_id)
        del self._requests[req_id]
        output = req.tokens[req.prompt_len:]
        if self.max_cached_requests == 0 or not output or req.private:
            return
        self._global.extend([0], output)
        self._cached.append((req_id, output))
        while len(self._cached) > self.max_cached_requests:
            _, old = self._cached.popleft()
            self._global.remove(old)

    # -- proposing ---------------------------------------------------------------------------------------

    def _match_cap(self, k: int) -> int:
        """Largest match length m in [1, D-1] maximising the proposal budget min(k, floor(f*m), D-m).

        The budget rises with m (the spec factor) and falls with it (depth left below the match), so the
        rule is: the longest match available, but no longer than this.
        """
        if k not in self._caps:
            cap, best_budget = 1, -1
            for m in range(1, self.max_depth):
                budget = self._budget(m, k)
                if budget >= best_budget:
                    cap, best_budget = m, budget
            self._caps[k] = cap
        return self._caps[k]

    def _budget(self, m: int, k: int) -> int:
        return max(0, min(k, int(self.max_spec_factor * m + 1e-6), self.max_depth - m))

    def propose(self, req_id: Hashable, k: int) -> tuple[list[int], list[float]]:
        """Propose up to ``k`` tokens continuing the request's context, with their confidences.

        Returns ``(tokens, confidences)``: ``confidences[i]`` is the product of the empirical step
        probabilities of ``tokens[: i + 1]`` (non-increasing, each >= ``min_token_prob``). ``([], [])`` when
        neither trie has an earlier occurrence of the context's last token followed by something, or k == 0.
        """
        if k < 0:
            raise ValueError(f"k={k} is negative: pass the number of tokens to propose, k >= 0 (0 proposes nothing)")
        req = self._get(req_id)
        if k == 0 or not req.tokens:
            return [], []
        cap = self._match_cap(k)

        # Own trie: active[m] is the node of the context's length-m suffix, so the longest one with a
        # continuation is a scan, no descent. `total` only shrinks as m grows (a longer string's occurrences
        # are a subset), so the first hit from the top is the longest.
        own: tuple[list[int], list[float]] = ([], [])
        for m in range(min(cap, len(req.active) - 1), 0, -1):
            node = req.active[m]
            if req.trie.total[node] > 0:
                own = req.trie.walk(node, self._budget(m, k), self.min_token_prob)
                break

        glob: tuple[list[int], list[float]] = ([], [])
        if self._cached and not req.private:
            ctx = req.tokens
            # The same monotonicity makes "suffix of length m has a continuation in the global trie" a
            # prefix-closed predicate of m: binary search for the longest, each probe a root descent (O(m)).
            glob_trie = self._global
            lo, hi, node_at = 0, min(cap, len(ctx)), -1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                node = glob_trie.descend(ctx[len(ctx) - mid:])
                if node >= 0 and glob_trie.total[node] > 0:
                    lo, node_at = mid, node
                else:
                    hi = mid - 1
            if node_at >= 0:  # lo only moves on a successful probe, so node_at is the node for `lo`
                glob = glob_trie.walk(node_at, self._budget(lo, k), self.min_token_prob)

        return own if sum(own[1]) >= sum(glob[1]) else glob


class SuffixDrafter(HostDrafter):
    """The engine's ``suffix`` drafter: one ``SuffixCache`` shared by all rows (so finished requests'
    outputs help later ones), each row drafting from its request's own trie and the cache."""

    kind = "suffix"

    def __init__(self, k: int | None = None, **cache_options) -> None:
        self.k = k
        self.cache = SuffixCache(**cache_options)
        self._request: dict[int, int] = {}  # row -> the request id the cache knows it by

    def start(self, row: int, ctx: RowContext) -> None:
        self._request[row] = ctx.request_id
        self.cache.start_request(ctx.request_id, ctx.prompt, private=ctx.private)

    def observe(self, row: int, new_tokens: Sequence[int], hidden=None) -> None:
        self.cache.add_tokens(self._request[row], new_tokens)

    def propose(self, row: int, tokens: Sequence[int], k: int) -> list[int]:
        return self.cache.propose(self._request[row], k)[0]

    def stop(self, row: int, finished: bool) -> None:
        request = self._request.pop(row, None)
        if request is not None:
            self.cache.stop_request(request)
