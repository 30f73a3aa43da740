"""A preallocated KV cache written at per-row positions, for Hugging Face decoder models.

Each batch row owns positions 0..S-1 of its cache. A forward writes the new keys and values at
the positions it is given (``scatter_``) and attends to every slot at or before the query's own
position. Rejecting draft tokens therefore only rewinds the row's length: the rejected entries
stay in place, hidden by the mask, and are overwritten by the next step. Nothing is copied,
cropped or resized, so every shape is fixed by (batch, max_len) and the step compiles once.

The class implements the one method transformers' attention layers call on a cache,
``update(key_states, value_states, layer_idx)``; the mask goes in as the model's prepared
``{"full_attention": mask}`` mapping, so the library builds none of its own.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.positions: torch.Tensor | None = None  # [B, T] where this forward writes

    def row(self, slot: int) -> StaticKVCache:
        """A view of one batch row (shared storage): prefill writes one request into its slot."""
        view = object.__new__(StaticKVCache)
        view.keys = [k[slot : slot + 1] for k in self.keys]
        view.values = [v[slot : slot + 1] for v in self.values]
        view.max_len, view.positions = self.max_len, None
        return view

    def first_rows(self, rows: int) -> StaticKVCache:
        """A view of rows 0..rows-1 (shared storage): a step at a smaller batch bucket."""
        view = object.__new__(StaticKVCache)
        view.keys = [k[:rows] for k in self.keys]
        view.values = [v[:rows] for v in self.values]
        view.max_len, view.positions = self.max_len, None
        return view

    @classmethod
    def for_model(cls, config, batch_size: int, max_len: int, dtype: torch.dtype, device) -> StaticKVCache:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, batch_size, config.num_key_value_heads, max_len, head_dim, dtype, device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [B, H, T, D] for the positions set in self.positions ([B, T]).
        B, H, T, D = key_states.shape
        index = self.positions.view(B, 1, T, 1).expand(B, H, T, D)
        self.keys[layer_idx].scatter_(2, index, key_states.to(self.keys[layer_idx].dtype))
        self.values[layer_idx].scatter_(2, index, value_states.to(self.values[layer_idx].dtype))
        return self.keys[layer_idx], self.values[layer_idx]

    def attention_mask(self, positions: torch.Tensor, additive_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Mask [B, 1, T, S]: query at position t sees cache slots 0..t of its own row. Boolean
        (True = attend) for SDPA-style attention; additive (0 / dtype min) for eager attention."""
        slots = torch.arange(self.max_len, device=positions.device)  # [S]
        visible = (slots.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)  # [B, 1, T, S]
        if additive_dtype is None:
            return visible
        mask = torch.zeros(visible.shape, dtype=additive_dtype, device=positions.device)
        return mask.masked_fill(~visible, torch.finfo(additive_dtype).min)

    # transformers queries these on some paths; a static cache answers with its capacity.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_len
