"""``train-draft`` for an EAGLE-3 head (``model.kind: eagle3``): distilled from the target's own features.

    train-draft --config configs/eagle3_code.yaml --profile quick

The recipe is ``TrainDraftRecipe``'s (setup, step, evaluate, save; the same loop, checkpoints,
resume, progress and W&B record) with the student replaced by an ``Eagle3Head``
(``serving.engine.eagle3``) and each step's loss computed so:

    1. the target's features and logits for every position of each row, from the forward the engine
       serves with (``ModelRunner.features``: prefill's code, layers and widths, at the precision
       the engine runs the target: q4 on Choral's CPU kernels for a bundled target), no grad
    2. the training-time test (``ttt_forward``): step 0 reads the pairs (f_p, x_{p+1}) and predicts
       x_{p+2}; step j feeds each row's own state from step j - 1 with the next token, one position
       further, attending to the true pairs up to p and its own entries since, as a served chain does
    3. the loss (``TTTLoss``): forward KL from the target's next-token distribution, restricted to
       the draft vocabulary and renormalised, at each step, weighted step_decay**j

The draft vocabulary is the domain text's ``model.draft_vocab`` most frequent tokens (plus EOS).
The held-out evaluation runs the head as served: a copy on the CPU kernels at the engine's draft
precision, an ``Eagle3Drafter`` beside the prepared target, greedy, HumanEval prompts for code.
best/ and final/ are speculators folders (``config.json`` + ``model.safetensors``) that ``serve``,
``spec-generate`` and vLLM load.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine import Request
from serving.engine.devices import release_host_memory
from serving.engine.drafters.eagle3 import Eagle3Drafter
from serving.engine.eagle3 import Eagle3Config, Eagle3Head, apply_rotary, rotary
from serving.engine.loader import build_engine, load_models, prepare_kernels, step_widths
from serving.engine.models import eos_token_ids
from serving.engine.runner import ModelRunner
from training.checkpoint import atomic_dir, write_manifest
from training.evaluate import summarize
from training.losses import DistillLoss
from training.students import frequent_tokens
from training.train import TrainDraftRecipe


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scaling: float) -> torch.Tensor:
    """The attention of unrolled step j = len(keys) - 1. q [B, T, h, D]; keys, values: per step
    [B, T, g, D]. Row p attends to step 0's entries of rows 0..p (the true pairs) and to its own
    entries of steps 1..j (what a chain wrote at positions p+1..p+j). Returns [B, T, h, D]."""
    B, T, h, D = q.shape
    rep = h // keys[0].shape[2]
    qh = q.transpose(1, 2)  # [B, h, T, D]
    k0 = keys[0].repeat_interleave(rep, dim=2).transpose(1, 2)  # [B, h, T, D]
    v0 = values[0].repeat_interleave(rep, dim=2).transpose(1, 2)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # [T, T]
    scores = (qh @ k0.transpose(-1, -2) * scaling).masked_fill(~causal, float("-inf"))  # [B, h, T, T]
    own = [(qh * k.repeat_interleave(rep, dim=2).transpose(1, 2)).sum(-1, keepdim=True) * scaling for k in keys[1:]]  # [B, h, T, 1] each
    weights = torch.softmax(torch.cat([scores, *own], dim=-1).float(), dim=-1).to(q.dtype)  # [B, h, T, T + j]
    out = weights[..., :T] @ v0  # [B, h, T, D]
    for i, v in enumerate(values[1:]):
        out = out + weights[..., T + i : T + i + 1] * v.repeat_interleave(rep, dim=2).transpose(1, 2)
    return out.transpose(1, 2)  # [B, T, h, D]


def ttt_forward(head: Eagle3Head, feats: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head unrolled ``steps`` times over whole rows. feats [B, L, n * Ht] (the target's, f_p at
    p), tokens [B, L]. Row p of step j sits at position p + j, reads x_{p+1+j} and predicts x_{p+2+j};
    returns each step's draft-vocabulary logits [B, L - 1, Vd]."""
    c = head.config
    B, L = tokens.shape
    T = L - 1
    h, g, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    positions = torch.arange(T, device=tokens.device).expand(B, T)  # [B, T]
    padded = F.pad(tokens, (0, steps))  # [B, L + steps]: past the row's end, any token (masked in the loss)
    hidden, keys, values, out = feats[:, :T], [], [], []
    for j in range(steps):
        x, residual = head.layer_input(padded[:, 1 + j : 1 + j + T], hidden)  # [B, T, 2H], [B, T, H]
        q, k, v = head.qkv(x).split([h * d, g * d, g * d], dim=-1)
        cos, sin = rotary(positions + j, d, c.rope_theta)  # [B, T, D]
        q, k = apply_rotary(q.view(B, T, h, d), cos, sin), apply_rotary(k.view(B, T, g, d), cos, sin)
        keys.append(k)
        values.append(v.view(B, T, g, d))
        attn = ttt_attention(q, keys, values, d**-0.5)  # [B, T, h, D]
        hidden = head.layer_output(attn.reshape(B, T, -1), residual)  # [B, T, H]: the next step's input
        out.append(head.logits(hidden))  # [B, T, Vd]
    return out


class TTTLoss(nn.Module):
    """The training-time-test loss: ``divergence`` (forward KL by default) between the target's
    distribution over the draft vocabulary and the head's, at every unrolled step, weighted
    ``decay**j`` and normalised by the weights' sum. ``forward(step_logits, teacher, mask)``:
    step_logits[j] [B, T, Vd]; teacher [B, L, Vd] (the target's logits at every position, draft
    columns); mask [B, L] (true where a token is trained on). Returns (loss, parts) with each
    step's loss and top-1 agreement for logging."""

    def __init__(self, kind: str = "forward_kl", decay: float = 0.8, temperature: float = 1.0) -> None:
        super().__init__()
        self.divergence = DistillLoss(kind, temperature=temperature)
        self.decay = decay

    def forward(self, step_logits: list[torch.Tensor], teacher: torch.Tensor, mask: torch.Tensor):
        T = step_logits[0].shape[1]
        total, weights, parts = 0.0, 0.0, {}
        for j, logits in enumerate(step_logits):
            # Step j at row p predicts x_{p+2+j}: the target's distribution at position p+1+j.
            target = F.pad(teacher, (0, 0, 0, j + 1))[:, 1 + j : 1 + j + T]  # [B, T, Vd]
            real = F.pad(mask, (0, j + 2))[:, 2 + j : 2 + j + T]  # [B, T]
            loss = self.divergence.divergence(logits, target, real)
            w = self.decay**j
            total, weights = total + w * loss, weights + w
            parts[f"loss_{j}"] = loss.detach()
            same = (logits.argmax(-1) == target.argmax(-1)) & real
            parts[f"agree_{j}"], parts[f"real_{j}"] = same.sum(), real.sum()
        return total / weights, parts


def init_from_target(head: Eagle3Head, target: nn.Module, layer_too: bool) -> None:
    """The head's final norm and LM head (its draft vocabulary's rows) from the target's, and with
    ``layer_too`` its MLP, o_proj and norms from the target's last decoder layer, where shapes agree
    (dequantized if the target is on the CPU kernels)."""
    ids = head.head_ids

    def weight(mod) -> torch.Tensor:
        return mod.dequantized() if hasattr(mod, "dequantized") else mod.weight.detach()

    with torch.no_grad():
        head.lm_head.weight.copy_(weight(target.get_output_embeddings()).float()[ids.to(head.lm_head.weight.device)])
        head.norm.weight.copy_(target.base_model.norm.weight.float())
        if not layer_too:
            return
        last, mine = target.base_model.layers[-1], head.layers[0]
        pairs = [(mine.mlp.gate_proj, last.mlp.gate_proj), (mine.mlp.up_proj, last.mlp.up_proj),
                 (mine.mlp.down_proj, last.mlp.down_proj), (mine.self_attn.o_proj, last.self_attn.o_proj)]  # fmt: skip
        for new, old in pairs:
            w = weight(old).float()
            if w.shape == new.weight.shape:
                new.weight.copy_(w)
        mine.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
        mine.hidden_norm.weight.copy_(last.input_layernorm.weight.float())


class Eagle3Recipe(TrainDraftRecipe):
    """``TrainDraftRecipe`` with an EAGLE-3 head as the student (see the module notes)."""

    def _setup_models(self) -> None:
        cfg, device = self.cfg, self.accelerator.device
        # The target as the engine serves it: the engine's settings resolved for this target
        # (a bundled target: q4 on the CPU kernels), prepared for the engine's step widths.
        settings = dataclasses.replace(cfg.eval.engine, device=device.type).resolved(cfg.model.target, device)
        self.settings = settings
        self.tokenizer, self.teacher, _ = load_models(settings, cfg.model.target)
        self.teacher.requires_grad_(False).eval()
        self.kernels = prepare_kernels(settings, [self.teacher], [], step_widths(settings, True, device))
        e = cfg.eagle3
        config = Eagle3Config.for_target(self.teacher.config, aux_layers=e.aux_layers, draft_vocab_size=cfg.model.draft_vocab,
                                         intermediate_size=e.intermediate_size, verifier=cfg.model.target)  # fmt: skip
        config.norm_before_residual = e.norm_before_residual
        config.speculative_tokens = cfg.eval.engine.k if isinstance(cfg.eval.engine.k, int) and cfg.eval.engine.k else 4
        self.student = Eagle3Head(config, embed=self.teacher.get_input_embeddings().weight.detach()).to(device)
        self.features = ModelRunner(self.teacher, batch_size=1, max_len=cfg.data.seq_len)
        self.features.capture_layers(config.aux_layers)
        self.vocab = config.vocab_size
        self.distill = True

    def _setup_student_head_and_adapters(self, labels: torch.Tensor, text_ids: torch.Tensor) -> None:
        cfg, head = self.cfg, self.student
        source = text_ids if len(text_ids) else labels
        always = eos_token_ids(self.teacher, self.tokenizer)
        ids = frequent_tokens(source, cfg.model.draft_vocab, always=always)[: cfg.model.draft_vocab]
        if len(ids) < cfg.model.draft_vocab:  # a small corpus: fill with the lowest ids not yet kept
            kept = set(ids)
            ids = sorted(ids + [t for t in range(self.vocab) if t not in kept][: cfg.model.draft_vocab - len(ids)])
        head.set_draft_vocab(ids)
        if cfg.eagle3.init == "target":
            init_from_target(head, self.teacher, layer_too=True)
        head.lm_head.weight.requires_grad_(cfg.eagle3.train_lm_head)
        self.student_params = sum(p.numel() for n, p in head.named_parameters() if n != "embed_tokens.weight")
        self.ttt_loss = TTTLoss(cfg.loss.kind, decay=cfg.eagle3.step_decay, temperature=cfg.loss.temperature)

    def _setup_loss_columns(self) -> None:
        self.columns = self.accelerator.unwrap_model(self.student).head_ids  # [Vd] target ids

    def teacher_rows(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's features [B, L, n * Ht] and draft-column logits [B, L, Vd] of each row,
        one row at a time through the serving forward (``ModelRunner.features``)."""
        feats, logits = [], []
        for row in input_ids:
            lg, f = self.features.features(row[None].to(self.features.device))
            feats.append(f)
            logits.append(lg[..., self.columns.to(lg.device)])
        dev = self.accelerator.device
        return torch.cat(feats).to(dev), torch.cat(logits).to(dev)

    def loss_step(self, model, input_ids: torch.Tensor, labels: torch.Tensor, with_agreement: bool = False):
        feats, teacher = self.teacher_rows(input_ids)
        with self.accelerator.autocast():
            steps = ttt_forward(model, feats, input_ids, self.cfg.eagle3.ttt_steps)
        return self.ttt_loss(steps, teacher, labels != -100)

    @torch.no_grad()
    def validate(self) -> dict:
        """Loss and top-1 agreement with the target per unrolled step on held-out rows."""
        model, dev, bs = self.accelerator.unwrap_model(self.student), self.accelerator.device, self.cfg.train.batch_size
        losses, agree, real = [], {}, {}
        for i in range(0, len(self.val_ids), bs):
            loss, parts = self.loss_step(model, self.val_ids[i : i + bs].to(dev), self.val_labels[i : i + bs].to(dev))
            losses.append(loss.item())
            for j in range(self.cfg.eagle3.ttt_steps):
                agree[j] = agree.get(j, 0) + int(parts[f"agree_{j}"])
                real[j] = real.get(j, 0) + int(parts[f"real_{j}"])
        out = {"val_loss": sum(losses) / max(len(losses), 1)}
        out |= {f"val_agreement_{j}": agree[j] / max(real[j], 1) for j in agree}
        out["val_agreement"] = out.get("val_agreement_0", 0.0)
        return out

    def served_drafter(self) -> Eagle3Drafter:
        """A copy of the head as the engine serves it: on the CPU kernels at the draft precision."""
        head = copy.deepcopy(self.accelerator.unwrap_model(self.student)).eval().requires_grad_(False)
        if self.kernels:
            head.use_kernels(self.settings.draft_weights)
        return Eagle3Drafter(head)

    def measure(self, drafter: Eagle3Drafter | None) -> dict:
        cfg = self.cfg
        k = cfg.eval.engine.k if isinstance(cfg.eval.engine.k, int) else max(cfg.eval.engine.k_buckets)
        max_len = max(len(p) for p in self.eval_prompts) + cfg.eval.max_new_tokens + k + 2
        drafters = {"eagle3": drafter} if drafter is not None else {}
        engine = build_engine(self.settings, self.tokenizer, self.teacher, drafters, max_len=max_len)
        outs = engine.generate([Request(p, max_new_tokens=cfg.eval.max_new_tokens) for p in self.eval_prompts])
        del engine
        release_host_memory()
        return summarize(outs)

    def evaluate(self, label: str) -> dict:
        result = self.measure(self.served_drafter())
        result.pop("token_ids")
        return result | {"label": label} | self.validate()

    def measure_target_alone(self) -> dict:
        return self.measure(None)  # the target is already prepared as served: build the engine over it

    def save_model(self, name: str) -> None:
        """The head as a speculators folder (config.json, model.safetensors) with the tokenizer."""
        with atomic_dir(self.out_dir / name) as tmp:
            self.accelerator.unwrap_model(self.student).save(tmp)
            self.tokenizer.save_pretrained(tmp)
            write_manifest(tmp)
