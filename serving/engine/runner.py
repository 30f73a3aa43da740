"""A loaded causal LM bound to its static KV cache, with one compiled forward per input width.

``ModelRunner.forward(tokens, positions)`` is the only way the engine calls a model. Shapes are
fixed by (batch size, input width T); T takes few values (1 or 2 for the draft, K+1 for the
target's verification, the prompt bucket for prefill), so each compiles once and is reused.
"""

from __future__ import annotations

import torch

from serving.engine.kv_cache import StaticKVCache


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        batch_size: int,
        max_len: int,
        vocab_size: int | None = None,
    ) -> None:
        """model: a Hugging Face causal LM (``base_model`` + output embeddings).
        vocab_size: width of the returned logits. A draft whose embedding matrix is padded to a
            different size than the target's is cut or padded (with -inf) to the target's width, so
            p and q live on the same vocabulary; the padding ids are never real tokens.
        """
        config = model.config
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ValueError(
                f"{type(model).__name__} uses attention layer types {sorted(layer_types)}; Choral's static "
                "cache supports full attention only (set use_sliding_window=False or pick another model)"
            )
        self.model = model
        self.config = config
        self.batch_size = batch_size
        self.max_len = max_len
        self.model_vocab = model.get_output_embeddings().out_features
        self.vocab_size = vocab_size or self.model_vocab
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # A reduced draft vocabulary (FR-Spec; see training.students.reduce_vocab): only these rows of
        # the output head are computed, the rest of the row is -inf, so the draft never proposes them
        # and the target's verification over the full vocabulary stays exact.
        self.head_ids: torch.Tensor | None = None
        kept = getattr(config, "draft_vocab", None)
        if kept:
            self.head_ids = torch.tensor(kept, dtype=torch.long, device=self.device)  # [N]
            head = model.get_output_embeddings()
            # A compact head holds only the kept rows, in draft_vocab order (train-draft evaluates
            # its student so, without a full-vocabulary copy of the head).
            compact = self.model_vocab == len(kept) and vocab_size is not None and vocab_size > len(kept)
            if compact:
                self.model_vocab = self.vocab_size
            top, limit = int(self.head_ids.max()), min(self.vocab_size, self.model_vocab)
            if top >= limit:  # an id must be a row of the draft's head and a column of the logits
                raise ValueError(f"draft_vocab names token id {top}, but the draft's head has {self.model_vocab} rows "
                                 f"and the logits {self.vocab_size} columns")  # fmt: skip
            if compact:
                kept_head = head
            elif hasattr(head, "select_rows"):  # Choral's CPU kernels (fp32 or int8): keep using them
                kept_head = head.select_rows(self.head_ids)
            else:
                kept_head = torch.nn.Linear(head.weight.shape[1], len(kept), bias=False, device=self.device, dtype=self.dtype)
                kept_head.weight = torch.nn.Parameter(head.weight.detach().index_select(0, self.head_ids).contiguous(), requires_grad=False)
            self.kept_head = kept_head  # [N, H] rows of the output head
        self.cache = StaticKVCache.for_model(config, batch_size, max_len, self.dtype, self.device)
        self._row_caches = {batch_size: self.cache}  # rows -> a view of the cache's first rows
        self.capture: tuple[int, ...] = ()  # layers whose input features forward() keeps (EAGLE-3's aux layers)
        self.prefill_features: torch.Tensor | None = None  # [1, L, n * H] the last prefill's, with capture
        self.last_features: torch.Tensor | None = None  # [B, T, n * H] the last forward's, with capture
        self._forward = self._eager_forward
        self._graphs: dict | None = None  # (rows, width, last_only) -> a captured CUDA graph (use_cuda_graphs)

    def capture_layers(self, layers: tuple[int, ...]) -> None:
        """From now on ``forward`` keeps its positions' features in ``last_features`` and
        ``prefill`` the prompt's in ``prefill_features``: [B, T, len(layers) * H], the residual
        stream entering each of ``layers`` (vLLM's ``eagle_aux_hidden_state_layer_ids``
        convention: what layer i reads; 0 is the token embeddings). Set it before compile."""
        n = self.config.num_hidden_layers
        bad = [i for i in layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"capture layers {bad} are not layers of this {n}-layer model: use ids in 0..{n - 1}")
        if self._graphs is not None:
            raise RuntimeError("capture layers before use_cuda_graphs: a captured graph has one output")
        self.capture = tuple(sorted(set(layers)))

    def compile(self, backend: str, shapes: int = 8) -> None:
        """Compile ``forward`` with ``fullgraph=True, dynamic=False``: one graph per (rows, input
        width), built on first use (``SpeculativeEngine.warmup`` pays that at load). ``shapes``:
        how many graphs of this method the engine uses (all its runners together); torch's limit
        of graphs per function is raised to it."""
        if self._graphs is not None:
            raise RuntimeError("compile the runner before use_cuda_graphs: the graphs replay the forward they captured")
        limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), shapes))
        self._forward = torch.compile(self._eager_forward, backend=backend, fullgraph=True, dynamic=False)

    def use_cuda_graphs(self) -> None:
        """Replay each (rows, input width) forward as a CUDA graph, captured on its first call (the
        engine's warm-up). On a GPU a small batch's step is bound by kernel launches, not by the
        chip; a graph launches the whole step at once. Capture works here because every shape is
        static and the cache is written at positions: the graph's inputs are fixed buffers the
        step copies into, and the KV cache tensors stay where they are. Eager or compiled."""
        if self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device; this model is on {self.device.type}: set "
                             "engine.device=cuda or engine.cuda_graphs=false")  # fmt: skip
        self._inner, self._graphs = self._forward, {}
        self._graph_pool = torch.cuda.graph_pool_handle()
        self._forward = self._graphed_forward

    def _graphed_forward(self, tokens: torch.Tensor, positions: torch.Tensor, last_only: bool, cache: StaticKVCache) -> torch.Tensor:
        key = (tokens.shape[0], tokens.shape[1], last_only)
        if key not in self._graphs:
            self._graphs[key] = self._capture(tokens, positions, last_only, cache)
        graph, static_tokens, static_positions, static_logits = self._graphs[key]
        static_tokens.copy_(tokens)
        static_positions.copy_(positions)
        graph.replay()
        # The next replay of this shape overwrites its output buffer while the caller may still
        # hold the last logits (the draft keeps q across its forwards): hand it its own copy.
        return static_logits.clone()

    def _capture(self, tokens, positions, last_only, cache):
        static_tokens, static_positions = tokens.clone(), positions.clone()  # [B, T] the graph's inputs
        # Warm up on a side stream first (cuBLAS handles, a compiled backend's first run): capture
        # records kernels, it must not create them. These runs rewrite the same KV the replay writes.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._inner(static_tokens, static_positions, last_only, cache)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            static_logits = self._inner(static_tokens, static_positions, last_only, cache)  # [B, T or 1, V]
        return graph, static_tokens, static_positions, static_logits

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """tokens, positions: [B, T] long, B at most ``batch_size``: the cache's first B rows (a
        batch bucket). Writes their KV at ``positions`` and returns fp32 logits [B, T, V] (or
        [B, 1, V] with ``last_only``: the draft's catch-up step needs only the last). With
        ``capture_layers`` the features of the same positions are kept in ``last_features``."""
        out = self._forward(tokens, positions, last_only, self._rows(tokens.shape[0]))
        if self.capture:
            out, self.last_features = out
        return out

    def _rows(self, rows: int) -> StaticKVCache:
        if rows not in self._row_caches:
            self._row_caches[rows] = self.cache.first_rows(rows)
        return self._row_caches[rows]

    @torch.no_grad()
    def warmup(self, widths, last_only: bool = False, rows: int | None = None) -> None:
        """Run ``forward`` once per input width (at ``rows`` rows, default all) so each compiled
        graph exists before the first request. The inputs have the layout the step passes
        (contiguous [B, T] tokens and positions): a compiled graph guards on strides too, so an
        ``expand``ed position tensor (stride 0) would compile a graph the step never uses and
        leave the real one to compile mid-request."""
        B, dev = rows or self.batch_size, self.device
        for width in widths:
            tokens = torch.zeros(B, width, dtype=torch.long, device=dev)  # [B, T]
            positions = torch.arange(width, device=dev).repeat(B, 1)  # [B, T] contiguous
            self.forward(tokens, positions, last_only=last_only)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, slot: int, pad_to: int | None = None) -> torch.Tensor:
        """tokens: [1, L] one prompt. Fills batch row ``slot`` of the cache at positions 0..L-1 and
        returns the logits after the last prompt token, [1, 1, V]. Other rows are untouched, so a
        request can join a running batch. ``pad_to`` right-pads to a fixed width (a prompt bucket
        for compiled backends); the padding lands past the prompt, hidden by the mask."""
        L = tokens.shape[1]
        if pad_to is not None and pad_to > L:
            tokens = torch.cat([tokens, tokens.new_zeros(1, pad_to - L)], dim=1)
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)  # [1, L']
        hidden = self._hidden(tokens, positions, self.cache.row(slot), self.capture)  # [1, L', H]
        if self.capture:  # the prompt's features, for a drafter that reads them (capture_layers)
            hidden, aux = hidden
            self.prefill_features = aux[:, :L]  # [1, L, n * H]
        return self._logits(hidden[:, L - 1 : L])

    @torch.no_grad()
    def features(self, tokens: torch.Tensor, slot: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens: [1, L]. What ``prefill`` computes for a prompt (the same forward, on batch row
        ``slot``), at every position: fp32 logits [1, L, V] and, with ``capture_layers``, the features
        [1, L, n * H]. Training an EAGLE-3 head reads the target this way, so the features it learns
        from are bitwise the ones the engine serves it at prefill (``tests/test_eagle3.py``)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)  # [1, L]
        hidden = self._hidden(tokens, positions, self.cache.row(slot), self.capture)
        hidden, aux = hidden if self.capture else (hidden, None)
        return self._logits(hidden), aux

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> None:
        """tokens, positions: [1, W]. Writes batch row ``slot``'s KV at ``positions`` from those
        tokens, alone, as ``prefill`` does (so what the row holds never depends on the other rows),
        and computes no logits: a draft catching up on tokens it did not draft."""
        self._hidden(tokens, positions, self.cache.row(slot))

    def _eager_forward(self, tokens: torch.Tensor, positions: torch.Tensor, last_only: bool, cache: StaticKVCache):
        if self.capture:
            hidden, aux = self._hidden(tokens, positions, cache, self.capture)  # [B, T, H], [B, T, n * H]
            return self._logits(hidden[:, -1:] if last_only else hidden), aux
        hidden = self._hidden(tokens, positions, cache)
        return self._logits(hidden[:, -1:] if last_only else hidden)

    def _hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, capture: tuple[int, ...] = ()):
        """The last hidden state [B, T, H]; with ``capture``, also the features of those layers."""
        lean = getattr(self.model, "_choral_decoder", None)
        if lean is not None and lean.enabled:  # Choral's CPU kernels: serving.engine.decoder
            return lean.hidden(tokens, positions, cache, capture)
        cache.positions = positions
        eager = self.config._attn_implementation == "eager"
        mask = cache.attention_mask(positions, self.dtype if eager else None)
        out = self.model.base_model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask={"full_attention": mask},
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=bool(capture),
        )
        if capture:  # hidden_states[i]: what layer i reads (0: the embeddings)
            return out.last_hidden_state, torch.cat([out.hidden_states[i] for i in capture], dim=-1)
        return out.last_hidden_state  # [B, T, H]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_ids is not None:
            kept = self.kept_head(hidden).float()  # [B, T, N]
            logits = kept.new_full((*kept.shape[:-1], self.vocab_size), float("-inf"))  # [B, T, V]
            return logits.index_copy(-1, self.head_ids, kept)
        logits = self.model.get_output_embeddings()(hidden).float()  # [B, T, V_model]
        if self.vocab_size < self.model_vocab:
            return logits[..., : self.vocab_size]
        if self.vocab_size > self.model_vocab:
            pad = logits.new_full((*logits.shape[:-1], self.vocab_size - self.model_vocab), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits
