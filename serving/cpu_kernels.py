"""Batch-invariant CPU Linear kernels that make multi-token verification cheap (draft)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("mkl", "onednn", "bf16")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, kernel: str, pack_batch: int, keep_weight: bool):
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        self.use_packed = True
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        if kernel == "mkl":
            self._packed = torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), pack_batch)
        elif kernel == "onednn":
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), pack_batch)
        elif kernel == "bf16":
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16).contiguous(), pack_batch)
        else:
            raise ValueError(kernel)
        if keep_weight:
            self.weight = linear.weight
        else:
            self.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
        self._shape_only = torch.zeros((), dtype=torch.float32).expand(self.out_features, self.in_features)

    def packed_nbytes(self) -> int:
        return self._packed.numel() * self._packed.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_packed:
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        if self.kernel == "mkl":
            y = torch.ops.mkl._mkl_linear(x2, self._packed, self._shape_only, self.bias, m)
        elif self.kernel == "onednn":
            if m == 1:
                y = torch.ops.mkldnn._linear_pointwise(x2.expand(2, -1).contiguous(), self._packed, self.bias, "none", [], "")[:1]
            else:
                y = torch.ops.mkldnn._linear_pointwise(x2, self._packed, self.bias, "none", [], "")
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2.to(torch.bfloat16), self._packed, None, "none", [], "").float()
            if self.bias is not None:
                y = y + self.bias
        return y.view(*lead, self.out_features)


def prepare_for_cpu(model: nn.Module, *, token_counts: Sequence[int] = (1, 5), kernel: str = "mkl", keep_weights: bool = True, attention: bool = True) -> nn.Module:
    pack_batch = max(2, *token_counts)
    if attention and hasattr(model, "set_attn_implementation"):
        use_rowwise_attention(model)
    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            if type(child) is nn.Linear:
                setattr(mod, cname, PackedLinear(child, kernel, pack_batch, keep_weights))
    return model


def set_packed(model: nn.Module, enabled: bool) -> None:
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.use_packed = enabled


ATTN_NAME = "choral_rowwise_sdpa"


def _rowwise_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len = query.shape[2]
    if attention_mask is None or attention_mask.dtype != torch.bool or q_len > 64:
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    outs = []
    for i in range(q_len):
        allowed = attention_mask[:, :, i, :]
        last = int(allowed.any(dim=(0, 1)).nonzero().max()) + 1
        row_mask = attention_mask[:, :, i : i + 1, :last]
        if bool(row_mask.all()):
            row_mask = None
        out, _ = sdpa_attention_forward(module, query[:, :, i : i + 1], key[:, :, :last], value[:, :, :last], row_mask, *args, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None


def use_rowwise_attention(model):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, _rowwise_sdpa)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    model.set_attn_implementation(ATTN_NAME)
    return model
