"""The EAGLE-3 head (Li et al. 2025): one decoder layer that drafts from the target's own features.

    head = Eagle3Head(Eagle3Config.for_target(target.config, draft_vocab_size=32000), embed=target_embeddings)
    head.save(folder, verifier="qwen2.5-coder-1.5b-instruct")    # the speculators folder vLLM loads
    head = Eagle3Head.from_folder(folder, embed=target_embeddings)

Input at position p: the target's features f_p (the residual stream entering each of
``aux_layers``, concatenated, [n * Ht]) and the token x_{p+1}. The head projects f_p to H (``fc``),
norms it (``hidden_norm``) and the token's embedding (``input_layernorm``), runs one decoder layer
whose attention reads both ([2H] -> q, k, v), and predicts x_{p+2} over its reduced draft
vocabulary. A draft chain feeds the layer's own output (before the final norm, [H]: no ``fc``)
back with the token it just drafted, one position further. This is the layout of vLLM's EAGLE-3
draft (``llama_eagle3.py``) and of the ``speculators`` checkpoint format, so a head trained here
loads there and one trained there (speculators, SpecForge, ModelOpt) loads here.

The draft vocabulary: ``lm_head`` has ``draft_vocab_size`` rows; draft id d is target id
d + ``d2t[d]``; ``t2d`` marks the target ids the head can propose. ``head_ids`` is the map as
target ids, which the drafter scatters its probabilities to (every other token gets q = 0, so the
acceptance rule stays exact over the target's whole vocabulary).

Serving (``step``) writes the layer's keys and values into a ``StaticKVCache`` at positions; on
Choral's CPU kernels (``use_kernels``) every row is computed on its own in a fixed order (the C++
norm, rotary-and-write, attention and SiLU of ``serving.engine.decoder``), so a row's draft never
depends on the batch. ``training.eagle3`` trains the same modules with the training-time test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine.kv_cache import StaticKVCache

SPECULATORS_TYPE = "eagle3"
WEIGHTS_FILE = "model.safetensors"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 feature layers: a low, a middle and a high one."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class Eagle3Config:
    """The head's shapes and what it reads; ``to_speculators``/``from_speculators`` map it to the
    speculators ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (the embedding's rows)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # vLLM's eagle_aux_hidden_state_layer_ids
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    norm_before_residual: bool = False
    verifier: str = ""  # the target's name or path
    verifier_architectures: tuple[str, ...] = ()
    speculative_tokens: int = 4  # the default proposal length written for vLLM
    extra: dict = field(default_factory=dict)  # keys of a loaded config this class does not read, written back

    def __post_init__(self) -> None:
        self.aux_layers = tuple(int(i) for i in self.aux_layers)
        if not self.aux_layers:
            raise ValueError("aux_layers is empty: an EAGLE-3 head reads the target's features of at least one layer")
        if not 2 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in 2..{self.vocab_size} (the target's vocabulary)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")  # fmt: skip

    @classmethod
    def for_target(cls, config, *, aux_layers=None, draft_vocab_size: int = 32000, intermediate_size: int | None = None,
                   verifier: str = "") -> Eagle3Config:  # fmt: skip
        """A head for a target of Hugging Face ``config``: its width, heads, rotary and norm epsilon,
        one layer; ``intermediate_size`` defaults to the target's."""
        n = config.num_hidden_layers
        layers = tuple(aux_layers) if aux_layers is not None else default_aux_layers(n)
        bad = [i for i in layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"aux_layers {bad} are not layers of the {n}-layer target: use ids in 0..{n - 1}")
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size, intermediate_size=intermediate_size or config.intermediate_size,
            num_attention_heads=heads, num_key_value_heads=getattr(config, "num_key_value_heads", heads),
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size, draft_vocab_size=min(draft_vocab_size, config.vocab_size),
            target_hidden_size=config.hidden_size, aux_layers=layers, rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta), max_position_embeddings=config.max_position_embeddings, verifier=verifier,
            verifier_architectures=tuple(getattr(config, "architectures", None) or ()),
        )  # fmt: skip

    def to_speculators(self) -> dict:
        """The speculators ``config.json`` (what vLLM's ``--speculative-config`` model folder holds)."""
        layer = {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        }  # fmt: skip
        out = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": SPECULATORS_TYPE,
            "speculators_version": "0.3.0", "draft_vocab_size": self.draft_vocab_size,
            "norm_before_residual": self.norm_before_residual, "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers), "transformer_layer_config": layer,
            "speculators_config": {
                "algorithm": SPECULATORS_TYPE,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": self.verifier, "architectures": list(self.verifier_architectures)},
            },
            "torch_dtype": "float32",
        }  # fmt: skip
        return self.extra | out

    @classmethod
    def from_speculators(cls, raw: dict, where: str = "config.json") -> Eagle3Config:
        if raw.get("speculators_model_type") != SPECULATORS_TYPE:
            raise ValueError(f"{where}: speculators_model_type is {raw.get('speculators_model_type')!r}, not "
                             f"{SPECULATORS_TYPE!r}: not an EAGLE-3 head in the speculators format")  # fmt: skip
        layer = raw.get("transformer_layer_config") or {}
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in layer]
        if missing or "draft_vocab_size" not in raw:
            raise ValueError(f"{where}: missing {missing or ['draft_vocab_size']} (transformer_layer_config holds the layer's shape)")
        heads = layer["num_attention_heads"]
        verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
        methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
        rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
        if aux is None:
            raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids is not set; Choral needs the target layers the "
                             "head was trained on (vLLM's default is (2, N/2, N-3) for an N-layer target): add them")  # fmt: skip
        later = [k for k in ("norm_output", "fc_norm", "norm_before_fc") if raw.get(k)]
        if later:
            raise ValueError(f"{where}: {later} set: an EAGLE 3.1 head (norms Choral's head does not have yet); serve it "
                             "with vLLM, or train one here (train-draft model.kind=eagle3)")  # fmt: skip
        known = {"architectures", "speculators_model_type", "speculators_version", "draft_vocab_size", "norm_before_residual",
                 "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "transformer_layer_config", "speculators_config",
                 "torch_dtype"}  # fmt: skip
        return cls(
            hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"], num_attention_heads=heads,
            num_key_value_heads=layer.get("num_key_value_heads", heads),
            head_dim=layer.get("head_dim") or layer["hidden_size"] // heads, vocab_size=layer["vocab_size"],
            draft_vocab_size=raw["draft_vocab_size"], target_hidden_size=raw.get("target_hidden_size") or layer["hidden_size"],
            aux_layers=tuple(aux), rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
            max_position_embeddings=layer.get("max_position_embeddings", 32768),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            verifier=verifier.get("name_or_path", ""), verifier_architectures=tuple(verifier.get("architectures") or ()),
            speculative_tokens=int(methods[0].get("speculative_tokens", 4)),
            extra={k: v for k, v in raw.items() if k not in known},
        )  # fmt: skip


def is_eagle3_folder(ref) -> bool:
    """Whether ``ref`` names a folder holding a speculators EAGLE-3 head."""
    try:
        raw = json.loads((Path(ref) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False
    return raw.get("speculators_model_type") == SPECULATORS_TYPE


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Eagle3Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        d = c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * d, c.hidden_size, bias=False)


class Eagle3MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # the token's embedding
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # the projected features (or own state)
        self.self_attn = Eagle3Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Eagle3MLP(c)


def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, D] of the rotate-half rotary embedding at ``positions`` [B, T]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))  # [D/2]
    freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, h, D] rotated by cos, sin [B, T, D] (rotate-half, as Llama and Qwen2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


class Eagle3Head(nn.Module):
    """The head's weights (named as in the speculators format) and its serving forward."""

    def __init__(self, config: Eagle3Config, embed: torch.Tensor | None = None) -> None:
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        if embed is not None:
            self.set_embeddings(embed)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, never trained
        self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(c)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        ids = torch.arange(c.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))  # draft id -> target id - draft id
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, ids, True))  # [V]
        self._ext = None  # the C++ row kernels, once use_kernels() installed them

    # ---- vocabulary ----------------------------------------------------------------------------

    def set_embeddings(self, embed: torch.Tensor) -> None:
        """The target's input embeddings [V, H] (shared in vLLM; a copy here, frozen)."""
        rows = min(embed.shape[0], self.config.vocab_size)
        with torch.no_grad():
            self.embed_tokens.weight[:rows].copy_(embed[:rows].float())

    def set_draft_vocab(self, target_ids) -> None:
        """The draft vocabulary as target ids, in draft-id order (``len == draft_vocab_size``)."""
        ids = torch.as_tensor(list(target_ids), dtype=torch.long)
        if ids.numel() != self.config.draft_vocab_size or len(set(ids.tolist())) != ids.numel():
            raise ValueError(f"the draft vocabulary holds {ids.numel()} ids ({len(set(ids.tolist()))} distinct); the head has "
                             f"{self.config.draft_vocab_size} rows")  # fmt: skip
        if int(ids.max()) >= self.config.vocab_size or int(ids.min()) < 0:
            raise ValueError(f"draft vocabulary id {int(ids.max())} is outside the target's {self.config.vocab_size} tokens")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_().index_fill_(0, ids, True)

    @property
    def head_ids(self) -> torch.Tensor:
        """[Vd] the target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    # ---- the forward, in pieces shared with training -------------------------------------------

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's features [.., n * Ht] to the head's width [.., H]; the head's own state
        (already [.., H]) passes as is."""
        return self.fc(hidden) if hidden.shape[-1] != self.config.hidden_size else hidden

    def _norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        if self._ext is not None:
            return self._ext.rowdot_rms_norm(x.reshape(-1, x.shape[-1]), norm.weight, norm.eps).view(x.shape)
        return norm(x)

    def layer_input(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T], hidden [B, T, n * Ht or H] -> the attention's input [B, T, 2H] and the
        residual [B, T, H] (the projected hidden, normed first with ``norm_before_residual``)."""
        layer = self.layers[0]
        h = self.project(hidden)  # [B, T, H]
        e = self._norm(self.embed_tokens(tokens), layer.input_layernorm)  # [B, T, H]
        normed = self._norm(h, layer.hidden_norm)
        residual = normed if self.config.norm_before_residual else h
        return torch.cat([e, normed], dim=-1), residual

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, 2H] -> [B, T, (h + 2 hkv) D]: q, k, v heads in that order (the rotary kernel's layout)."""
        a = self.layers[0].self_attn
        return torch.cat([a.q_proj(x), a.k_proj(x), a.v_proj(x)], dim=-1)

    def layer_output(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn [B, T, h * D] (before o_proj) -> the layer's output before the final norm [B, T, H]:
        what a chain feeds back."""
        layer = self.layers[0]
        residual = residual + layer.self_attn.o_proj(attn)
        x = self._norm(residual, layer.post_attention_layernorm)
        mlp = layer.mlp
        if self._ext is not None:
            gu = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)  # [B, T, 2I]
            act = self._ext.rowdot_silu_mul(gu.reshape(-1, gu.shape[-1]), self.config.intermediate_size).view(*x.shape[:-1], -1)
        else:
            act = F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)  # [B, T, I]
        return residual + mlp.down_proj(act)

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """[B, T, H] (before the final norm) -> fp32 logits over the draft vocabulary [B, T, Vd]."""
        return self.lm_head(self._norm(state, self.norm)).float()

    # ---- serving -------------------------------------------------------------------------------

    def new_cache(self, batch_size: int, max_len: int) -> StaticKVCache:
        c = self.config
        return StaticKVCache(1, batch_size, c.num_key_value_heads, max_len, c.head_dim, torch.float32, self.embed_tokens.weight.device)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache):
        """tokens, positions [B, T]; hidden [B, T, n * Ht] (the target's features) or [B, T, H]
        (the head's own state). Writes the layer's keys and values at ``positions`` of the cache's
        first B rows; returns (logits [B, T, Vd] fp32, state [B, T, H])."""
        c = self.config
        B, T = tokens.shape
        x, residual = self.layer_input(tokens, hidden)
        qkv = self.qkv(x)  # [B, T, (h + 2 hkv) D]
        cos, sin = rotary(positions, c.head_dim, c.rope_theta)  # [B, T, D]
        kc, vc = cache.keys[0], cache.values[0]  # [>= B, hkv, S, D]
        mask = cache.attention_mask(positions)[:, 0]  # [B, T, S]: a query sees its row's slots up to its position
        scaling = c.head_dim**-0.5
        if self._ext is not None:
            q = self._ext.rowdot_rope_write(qkv, cos, sin, positions, kc, vc, c.num_attention_heads, c.num_key_value_heads)
            attn = self._ext.rowdot_attention(q, kc[:B], vc[:B], mask, scaling)  # [B, T, h, D]
        else:
            h, g, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            q, k, v = qkv.split([h * d, g * d, g * d], dim=-1)
            q = apply_rotary(q.view(B, T, h, d), cos, sin)  # [B, T, h, D]
            k = apply_rotary(k.view(B, T, g, d), cos, sin).transpose(1, 2)  # [B, g, T, D]
            index = positions[:, None, :, None].expand(B, g, T, d)
            kc[:B].scatter_(2, index, k)
            vc[:B].scatter_(2, index, v.view(B, T, g, d).transpose(1, 2))
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), kc[:B], vc[:B], attn_mask=mask[:, None], scale=scaling,
                                                  enable_gqa=True).transpose(1, 2)  # fmt: skip
        state = self.layer_output(attn.reshape(B, T, -1), residual)  # [B, T, H]
        return self.logits(state), state

    def use_kernels(self, weights: str = "fp32", max_rows: int = 16) -> bool:
        """Run on Choral's CPU kernels (CPU, fp32 weights): every Linear as ``weights`` (fp32
        row-invariant, int8 W8A8 or q4 4-bit groups), norms, rotary, attention and SiLU in the C++
        row kernels. Returns whether they apply here (else the head stays on torch ops)."""
        from serving.engine import cpu_kernels

        if self.embed_tokens.weight.device.type != "cpu" or not cpu_kernels.rowdot_available():
            return False
        cpu_kernels.prepare_for_cpu(self, token_counts=tuple(range(1, max_rows + 1)), weights=weights, attention=False,
                                    lean=False, cache=False, requantize=True, max_rows=max_rows)  # fmt: skip
        self._ext = cpu_kernels._rowdot_ext()
        return True

    # ---- the folder ----------------------------------------------------------------------------

    def save(self, folder: str | Path, *, with_embeddings: bool = False) -> None:
        """``config.json`` and ``model.safetensors`` in the speculators layout (the embeddings are the
        target's and left out unless ``with_embeddings``: vLLM shares the target's)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()
                   if with_embeddings or k != "embed_tokens.weight"}  # fmt: skip
        save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(self.config.to_speculators(), indent=2) + "\n")

    @classmethod
    def from_folder(cls, folder: str | Path, embed: torch.Tensor | None = None) -> Eagle3Head:
        """A head saved by ``save`` or by speculators: ``embed`` (the target's embeddings) where the
        folder holds none."""
        from safetensors.torch import load_file

        folder = Path(folder)
        config = Eagle3Config.from_speculators(json.loads((folder / "config.json").read_text()), str(folder / "config.json"))
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder} holds no .safetensors weights")
        tensors = {}
        for f in files:
            tensors |= load_file(str(f))
        tensors = {k.removeprefix("model."): v for k, v in tensors.items()}  # some writers prefix the decoder's names
        head = cls(config)
        if "embed_tokens.weight" not in tensors:
            if embed is None:
                raise ValueError(f"{folder} holds no embed_tokens.weight: pass the target's embeddings (embed=...)")
            head.set_embeddings(embed)
        if "t2d" not in tensors and "d2t" in tensors:
            tensors["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(
                0, torch.arange(config.draft_vocab_size) + tensors["d2t"].long(), True)  # fmt: skip
        missing, unexpected = head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()},
                                                   strict=False)  # fmt: skip
        missing = [k for k in missing if k != "embed_tokens.weight"]
        if missing or unexpected:
            raise ValueError(f"{folder}: weights missing {missing}, unexpected {unexpected}: not the one-layer EAGLE-3 "
                             "layout (fc, layers.0.*, norm, lm_head, d2t, t2d)")  # fmt: skip
        head.d2t, head.t2d = head.d2t.long(), head.t2d.bool()
        return head.eval().requires_grad_(False)
