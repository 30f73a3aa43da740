"""A lean decoder forward for Llama-family models (Qwen2, Llama) on Choral's CPU kernels.

On a CPU the kernels made the weights cheap enough that the rest of a Hugging Face forward showed:
a fair share of a q4 decode step went outside the kernels (28 layers of about 45 small torch ops
each, module calls, mask and cache bookkeeping; measured in docs/architecture.md). This forward runs the
same layers on the same weights in about a dozen calls a layer:

    1. RMSNorm (one C++ call)          5. o_proj, residual add
    2. q, k, v in one fused Linear     6. RMSNorm
    3. rotary + cache write (C++)      7. gate and up in one fused Linear, SiLU x up (C++)
    4. attention (C++, ``rowdot_attention``; SDPA for a prefill longer than max_rows)
                                       8. down, residual add

Every row is computed on its own in a fixed order, as in the kernels, so row i of a K+1-token
verify stays bitwise equal to the one-token step (``tests/test_decoder.py``). Its numerics are
not bitwise the Hugging Face forward's (RMSNorm and rotary round in another order), so the engine
uses one or the other for a model, never both: ``prepare_for_cpu`` installs it where the model
fits (``LeanDecoder.build`` returns None otherwise) and ``ModelRunner`` then runs every forward
of that model, prefill included, through it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_ATTENTION = ("Qwen2Attention", "LlamaAttention")


class LeanLayer:
    def __init__(self, layer: nn.Module, fuse) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        cfg = attn.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.scaling = attn.head_dim, float(attn.scaling)
        self.in_norm = (layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon))
        self.post_norm = (layer.post_attention_layernorm.weight, float(layer.post_attention_layernorm.variance_epsilon))
        # One call where the three (two) projections share a kind; the separate modules keep
        # working on views of the fused storage.
        self.qkv = fuse([attn.q_proj, attn.k_proj, attn.v_proj]) or _Concat([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up = fuse([mlp.gate_proj, mlp.up_proj]) or _Concat([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj
        self.intermediate = mlp.gate_proj.out_features


class _Concat:
    """Projections of different kinds (a Q6_K v_proj beside Q4_K q and k): called one by one."""

    def __init__(self, mods) -> None:
        self.mods = mods

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.mods], dim=-1)


class LeanDecoder:
    """``hidden(tokens, positions, cache)``: the base model's last hidden state [B, T, H], the KV
    written into ``cache`` (a ``StaticKVCache`` view) at ``positions``."""

    def __init__(self, model: nn.Module, ext, fuse, max_rows: int) -> None:
        base = model.base_model
        self.ext, self.max_rows, self.enabled = ext, max_rows, True
        self.embed = base.embed_tokens
        self.norm = (base.norm.weight, float(base.norm.variance_epsilon))
        self.inv_freq = base.rotary_emb.inv_freq  # [D/2]
        self.rope_scale = float(getattr(base.rotary_emb, "attention_scaling", 1.0))
        self.layers = [LeanLayer(layer, fuse) for layer in base.layers]

    @classmethod
    def build(cls, model: nn.Module, ext, fuse, max_rows: int) -> LeanDecoder | None:
        """The lean forward for ``model``, or None where it does not fit exactly: another layer
        type, activation, rotary scaling or norm, or weights outside fp32."""
        base = getattr(model, "base_model", None)
        cfg = getattr(model, "config", None)
        if base is None or cfg is None or ext is None or not hasattr(base, "layers"):
            return None
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if getattr(cfg, "hidden_act", None) != "silu" or rope != "default" or getattr(cfg, "use_sliding_window", False):
            return None
        for layer in base.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if type(attn).__name__ not in SUPPORTED_ATTENTION or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
                return None
            if getattr(attn, "sliding_window", None) or not hasattr(layer.input_layernorm, "variance_epsilon"):
                return None
        if base.norm.weight.dtype != torch.float32 or base.embed_tokens.weight.dtype != torch.float32:
            return None
        return cls(model, ext, fuse, max_rows)

    def _rms(self, x: torch.Tensor, norm) -> torch.Tensor:  # [B, T, H] -> [B, T, H]
        return self.ext.rowdot_rms_norm(x.reshape(-1, x.shape[-1]), norm[0], norm[1]).view(x.shape)

    @torch.no_grad()
    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cache, capture: tuple[int, ...] = ()):
        """The last hidden state [B, T, H]; with ``capture`` (layer ids) also the residual stream
        entering each of those layers, concatenated [B, T, len(capture) * H] (vLLM's EAGLE-3
        convention: id i is what layer i reads, so 0 is the token embeddings)."""
        B, T = tokens.shape
        aux = []
        # Activations stay [B, T, H]: the fp32 kernels tell a step from a prefill by T, the tokens
        # per sequence, and would take a batch of short steps flattened to [B*T, H] for a prefill.
        h = self.embed(tokens)  # [B, T, H]
        # 0. Once per forward: rotary tables and the mask (every layer shares them).
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale  # [B, T, D]
        mask = cache.attention_mask(positions)[:, 0]  # [B, T, S] bool
        step = T <= self.max_rows
        if not step:  # a prefill: SDPA over the slots any row may see
            seen = mask.flatten(0, 1).any(dim=0).nonzero()
            extent = int(seen.max()) + 1 if seen.numel() else mask.shape[-1]
        for i, L in enumerate(self.layers):
            if i in capture:
                aux.append(h)
            kc, vc = cache.keys[i], cache.values[i]
            # 1-3. norm, fused q/k/v, rotary and the cache write.
            qkv = L.qkv(self._rms(h, L.in_norm))  # [B, T, (H + 2 Hkv) D]
            q = self.ext.rowdot_rope_write(qkv, cos, sin, positions, kc, vc, L.heads, L.kv_heads)  # [B, T, H, D]
            # 4. Attention: each row over exactly its own slots.
            if step:
                attn = self.ext.rowdot_attention(q, kc, vc, mask, L.scaling)  # [B, T, H, D]
            else:
                attn = F.scaled_dot_product_attention(
                    q.transpose(1, 2), kc[:B, :, :extent], vc[:B, :, :extent], attn_mask=mask[:, None, :, :extent],
                    scale=L.scaling, enable_gqa=True).transpose(1, 2)  # fmt: skip
            # 5. Output projection and residual.
            h = h + L.o_proj(attn.reshape(B, T, -1))
            # 6-8. MLP.
            gu = L.gate_up(self._rms(h, L.post_norm))  # [B, T, 2I]: gate, then up
            act = self.ext.rowdot_silu_mul(gu.reshape(B * T, -1), L.intermediate).view(B, T, -1)  # [B, T, I]
            h = h + L.down(act)
        out = self._rms(h, self.norm)  # [B, T, H]
        return (out, torch.cat(aux, dim=-1)) if capture else out
