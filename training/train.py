"""The ``train-draft`` loop: fine-tune (cross-entropy) or distill a draft from the target.

A recipe in the style of torchtune's knowledge-distillation recipe (``KDRecipeSingleDevice``), no
Trainer: ``TrainDraftRecipe.setup`` builds the models, rows, loader, optimizer and schedule (and
restores ``last/`` on resume), then ``train`` runs, for each optimizer step:

    1. teacher logits under no_grad (skipped when fine-tuning with cross-entropy only)
    2. student logits, loss over real tokens (the loss module of training/losses.py)
    3. backward, clip, optimizer and LR schedule step (accelerate handles devices, processes,
       gradient accumulation and bf16 autocast)
    4. every ``eval.every`` steps: held-out acceptance measured with Choral's engine; the best
       student is saved in Hugging Face format (best/)
    5. every ``output.save_every`` steps: a resumable state (last/), written atomically

``training.recipes.train(cfg, resume=...)`` runs the recipe from start to end (the CLI and the tests call it). Run
it on one process or with ``accelerate launch --num_processes N -m training.cli ...``.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from serving.config import to_dict
from serving.engine.devices import release_host_memory
from serving.engine import Request
from serving.engine.models import (
    check_same_tokenizer,
    eos_token_ids,
    load_model,
    load_tokenizer,
)
from serving.files import atomic_path
from serving.prompts import EVAL_ROWS, encode_prompt, load_prompts
from training import data as data_mod
from training.checkpoint import (
    CheckpointError,
    atomic_dir,
    keep_previous,
    read_progress_file,
    resumable,
    write_json_atomic,
    write_manifest,
)
from training.config import TrainDraftConfig
from training.evaluate import held_out_prompts, measure
from training.exercises import write_exercises
from training.generate import target_generate
from training.losses import DistillLoss
from training.metric_logging import log_run
from training.students import (
    add_lora,
    count_parameters,
    derive_student,
    eval_model,
    frequent_tokens,
    keep_head_rows,
    plain_model,
    reduce_vocab,
    untie_head,
)


def lr_lambda(cfg: TrainDraftConfig):
    warmup, total = cfg.optim.warmup_steps, cfg.train.max_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.optim.schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_student(cfg: TrainDraftConfig, device: torch.device) -> torch.nn.Module:
    student = load_model(cfg.model.student, dtype=cfg.model.dtype, device=device)
    if cfg.model.student_layers is not None:
        student = derive_student(student, cfg.model.student_layers)
    student.requires_grad_(True)
    if cfg.model.trainable == "head":
        student.requires_grad_(False)
        if cfg.model.draft_vocab is None:  # else only the kept rows train (keep_head_rows, once they are known)
            untie_head(student).weight.requires_grad_(True)
    elif not cfg.model.train_embeddings:
        student.get_input_embeddings().requires_grad_(False)
    return student.train()


def on_policy_prompts(cfg: TrainDraftConfig, tokenizer, texts: list[str], teacher=None, out_dir: Path | None = None) -> list[list[int]]:
    """Training prompts: chat and math take rows past the evaluation ones; code (HumanEval is
    evaluation-only) takes HumanEval-shaped stubs (signature + docstring), either of the training
    sources' functions, topped up with the first lines of source files, or exercises the target
    (``teacher``) writes itself, cached in ``out_dir``; local files take their first lines.
    Empty prompts are dropped."""
    n = cfg.data.on_policy_prompts
    heads = lambda docs: ["\n".join(t.splitlines()[:12]) for t in docs]
    if cfg.data.files:
        prompts = [tokenizer.encode(t, add_special_tokens=False)[:128] for t in heads(texts[:n])]
    elif cfg.data.domain == "code" and cfg.data.code_prompts == "target_exercises":
        humaneval = [p.text for p in load_prompts("code", data_mod.HUMANEVAL_ROWS)]
        stubs = write_exercises(teacher, tokenizer, n, seed=cfg.train.seed, cache=out_dir / "exercises.json", eval_prompts=humaneval)
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in stubs]
    elif cfg.data.domain == "code":
        stubs = data_mod.function_stubs(texts, n)
        stubs += heads(texts[: n - len(stubs)])
        prompts = [tokenizer.encode(t, add_special_tokens=False)[-256:] for t in stubs]
    else:
        prompts = [encode_prompt(tokenizer, p)[-256:] for p in load_prompts(cfg.data.domain, n, offset=EVAL_ROWS)]
    return [p for p in prompts if p]


def on_policy_rows(cfg: TrainDraftConfig, teacher, tokenizer, prompts: list[list[int]], out_dir: Path) -> list[list[int]]:
    """Sequences the target itself generates from ``prompts`` (DistillSpec's on-policy data), one
    per prompt, cached in the run folder and reused on resume and later runs: a cached row is kept
    when it starts with its prompt, so raising ``on_policy_prompts`` generates only the new ones."""
    cache = out_dir / "on_policy.pt"
    cached = torch.load(cache) if cache.exists() else []
    rows = [r if i < len(cached) and (r := cached[i])[: len(p)] == p else None for i, p in enumerate(prompts)]
    todo = [i for i, r in enumerate(rows) if r is None]
    if not todo:
        return rows
    requests = [Request(prompts[i], max_new_tokens=cfg.data.on_policy_new_tokens) for i in todo]
    done = target_generate(teacher, tokenizer, requests, desc=f"on-policy data ({len(prompts) - len(todo)} cached)")
    for i, completion in zip(todo, done):
        rows[i] = prompts[i] + completion.token_ids
    with atomic_path(cache) as tmp:  # an interrupted run never leaves half a cache
        torch.save(rows, tmp)
    return rows


def build_rows(cfg: TrainDraftConfig, tokenizer, teacher, out_dir: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training rows (input_ids, labels), both [N, seq_len]: domain or file texts packed to a fixed
    length, plus on-policy sequences right-padded (labels -100 on padding); and every packed text
    row before the ``max_rows`` cut (what a reduced draft vocabulary is counted over)."""
    if cfg.data.files:
        texts = [t for f in cfg.data.files for t in data_mod.load_local_texts(f)][: cfg.data.n_docs]
    else:
        texts = data_mod.load_domain_texts(cfg.data.domain, cfg.data.n_docs, tokenizer=tokenizer, seed=cfg.train.seed)
    if cfg.data.domain == "code" and not cfg.data.files:
        data_mod.assert_no_eval_overlap(texts, [p.text for p in load_prompts("code", data_mod.HUMANEVAL_ROWS)])
    eos = tokenizer.eos_token_id
    text_ids = data_mod.tokenize_and_pack(texts, tokenizer, cfg.data.seq_len, eos)  # [N_all, L]
    ids = text_ids[: cfg.data.max_rows]
    labels = ids.clone()
    if cfg.data.on_policy:
        prompts = on_policy_prompts(cfg, tokenizer, texts, teacher, out_dir)
        generated = on_policy_rows(cfg, teacher, tokenizer, prompts, out_dir)
        more_ids, more_labels = data_mod.pad_to_fixed([r[: cfg.data.seq_len] for r in generated], cfg.data.seq_len, eos)
        if cfg.data.answers_only:  # learn the target's answers, not the prompts they answer
            for row, p in enumerate(prompts):  # on_policy_rows keeps only rows that start with their prompt
                more_labels[row, : len(p)] = data_mod.IGNORE_INDEX
        ids, labels = torch.cat([ids, more_ids]), torch.cat([labels, more_labels])
    if len(ids) < 2:
        raise ValueError(f"only {len(ids)} training rows of {cfg.data.seq_len} tokens: raise data.n_docs or lower data.seq_len")
    return ids, labels, text_ids


def plot_history(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot([h["step"] for h in history if "loss" in h], [h["loss"] for h in history if "loss" in h])
    ax[0].set_xlabel("step"), ax[0].set_ylabel("training loss")
    evals = [h for h in history if "acceptance_rate" in h]
    ax[1].plot([h["step"] for h in evals], [h["acceptance_rate"] for h in evals], marker="o")
    ax[1].set_xlabel("step"), ax[1].set_ylabel("held-out acceptance (greedy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class TrainDraftRecipe:
    """One train-draft run, in the shape of torchtune's ``KDRecipeSingleDevice``:

        recipe = TrainDraftRecipe(cfg)
        recipe.setup(resume=False)   # models, rows, loader, optimizer, schedule, resumed state
        progress = recipe.train()    # step() until max_steps or the time budget; evaluate() and
                                     # save_checkpoint() at their intervals; final/ and metrics.json
        recipe.cleanup()             # every process waits for the main one's last writes

    One instance is one process of an accelerate launch. ``progress`` is the run's record (step,
    tokens seen, best acceptance, metric history, the before/after evaluations): it is what
    ``last/progress.json`` saves and ``--resume`` restores, and what ``metrics.json`` finally holds,
    so it stays a plain dict. Only the main process evaluates and writes best/ and final/.
    """

    def __init__(self, cfg: TrainDraftConfig) -> None:
        self.cfg = cfg
        self.out_dir = Path(cfg.output.dir)
        self.accelerator = Accelerator(
            mixed_precision=cfg.train.mixed_precision, gradient_accumulation_steps=cfg.train.grad_accum,
            cpu=cfg.train.device == "cpu",
        )  # fmt: skip
        self.is_main = self.accelerator.is_main_process

    # ---- setup ---------------------------------------------------------------------------------

    def setup(self, *, resume: bool = False) -> None:
        """Build everything the loop needs. The order is the seeded order every run (and every
        resumed run) takes: LoRA initialisation draws from the seeded RNG after the models and rows."""
        cfg = self.cfg
        set_seed(cfg.train.seed)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._setup_models()
        ids, labels, text_ids = build_rows(cfg, self.tokenizer, self.teacher, self.out_dir)
        self._setup_student_head_and_adapters(labels, text_ids)
        self._setup_data(ids, labels)
        self._setup_optimizer()
        self.loss_fn = DistillLoss(cfg.loss.kind, ce_ratio=cfg.loss.ce_ratio, temperature=cfg.loss.temperature, beta=cfg.loss.beta)
        self.progress = {"step": 0, "tokens": 0, "best_acceptance": -1.0, "history": [], "config": to_dict(cfg)}
        if resume:
            self._load_checkpoint()
        self.eval_prompts = held_out_prompts(cfg.data.domain, cfg.eval.prompts, self.tokenizer)
        self._setup_loss_columns()

    def _setup_models(self) -> None:
        cfg, device = self.cfg, self.accelerator.device
        self.tokenizer = load_tokenizer(cfg.model.target)
        check_same_tokenizer(self.tokenizer, load_tokenizer(cfg.model.student), draft_name=f"student {cfg.model.student!r}")
        self.distill = cfg.loss.kind != "ce" and cfg.loss.ce_ratio < 1.0  # the teacher's logits carry weight
        self.teacher = load_model(cfg.model.target, dtype=cfg.model.dtype, device=device)
        self.student = build_student(cfg, device)
        self.vocab = min(self.teacher.get_output_embeddings().weight.shape[0], self.student.get_output_embeddings().weight.shape[0])

    def _setup_student_head_and_adapters(self, labels: torch.Tensor, text_ids: torch.Tensor) -> None:
        """The reduced draft vocabulary (``model.draft_vocab``) and LoRA adapters (``model.lora_rank``)."""
        cfg = self.cfg
        if cfg.model.draft_vocab is not None:
            # Counted over all the domain text read (not just the rows trained on, which may hold fewer
            # distinct tokens than the head keeps), so runs over the same text get the same head.
            source = text_ids if len(text_ids) else labels
            always = eos_token_ids(self.teacher, self.tokenizer)
            reduce_vocab(self.student, frequent_tokens(source, cfg.model.draft_vocab, always=always))
        self.student_params = count_parameters(plain_model(self.student))  # the plain model that is saved and served
        if cfg.model.trainable == "head" and cfg.model.draft_vocab is not None:
            keep_head_rows(self.student)  # its logits then cover the kept tokens only
        if cfg.model.lora_rank:
            self.student = add_lora(self.student, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_targets)

    def _setup_data(self, ids: torch.Tensor, labels: torch.Tensor) -> None:
        """Split the rows (``ids``, ``labels``: [N, seq_len]) into a shuffled training loader and
        held-out validation rows."""
        cfg = self.cfg
        train_idx, val_idx = data_mod.split_train_val(list(range(len(ids))), cfg.data.val_fraction, cfg.train.seed)
        self.val_ids, self.val_labels = ids[val_idx], labels[val_idx]  # [N_val, seq_len] each
        self.loader = DataLoader(
            TensorDataset(ids[train_idx], labels[train_idx]), batch_size=cfg.train.batch_size, shuffle=True,
            drop_last=True, generator=torch.Generator().manual_seed(cfg.train.seed),
        )  # fmt: skip
        if len(self.loader) == 0:
            raise ValueError(f"{len(train_idx)} training rows < batch_size={cfg.train.batch_size}: lower train.batch_size")

    def _setup_optimizer(self) -> None:
        """AdamW over the trainable parameters and the LR schedule, then accelerate wraps the
        student, optimizer, loader and schedule for its devices and processes."""
        cfg = self.cfg
        trainable = [p for p in self.student.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        self.student, self.optimizer, self.loader, self.scheduler = self.accelerator.prepare(
            self.student, optimizer, self.loader, scheduler
        )

    def _load_checkpoint(self) -> None:
        """``--resume``: the last complete last/ (model, optimizer, schedule, RNG, progress), if any,
        checked against its manifest first; a damaged last/ falls back to previous/."""
        if (folder := resumable(self.out_dir, log=self.accelerator.print, unchecked=self.cfg.output.resume_unchecked)) is None:
            return
        saved = read_progress_file(folder)
        try:
            self.accelerator.load_state(str(folder / "state"))
        except Exception as e:  # a checkpoint from before manifests, damaged: name it
            raise CheckpointError(f"{folder / 'state'} could not be loaded ({type(e).__name__}: {e}); delete {folder} "
                                  "and resume from an earlier checkpoint, or start over") from e  # fmt: skip
        self.progress = saved
        self.accelerator.print(f"resumed from step {self.progress['step']} ({folder})")

    def _setup_loss_columns(self) -> None:
        """The columns the loss sees: every token, or (loss.draft_vocab_only) the draft's own, which
        is the distribution a reduced draft is served with; labels outside them are not trained on."""
        self.columns, self.column_of = slice(0, self.vocab), None
        self.columns_list = range(self.vocab)
        if self.cfg.loss.draft_vocab_only:
            device = self.accelerator.device
            self.columns = torch.tensor(self.accelerator.unwrap_model(self.student).config.draft_vocab, device=device)  # [V']
            self.column_of = torch.full((self.vocab,), -100, dtype=torch.long, device=device)  # [V] token id -> column
            self.column_of[self.columns] = torch.arange(len(self.columns), device=device)
            self.columns_list = self.columns.tolist()

    # ---- one step ------------------------------------------------------------------------------

    def loss_step(self, model, input_ids: torch.Tensor, labels: torch.Tensor, with_agreement: bool = False):
        """The loss of ``model`` on a batch (``input_ids``, ``labels``: [B, L]) and its parts; with
        ``with_agreement``, also the count of real tokens where its argmax is the teacher's."""
        labels = labels[:, 1:]  # [B, L-1] next-token targets, -100 on padding
        if self.column_of is not None:
            labels = torch.where(labels >= 0, self.column_of[labels.clamp(min=0)], labels)
        mask = labels != -100  # [B, L-1]
        s_logits = model(input_ids=input_ids).logits[:, :-1]  # [B, L-1, V] (V' with a KeptHead)
        if s_logits.shape[-1] != len(self.columns_list):
            s_logits = s_logits[..., self.columns]  # [B, L-1, V']
        t_logits = None
        if self.distill or with_agreement:
            with torch.no_grad(), self.accelerator.autocast():  # bf16 like the student under mixed_precision
                t_logits = self.teacher(input_ids=input_ids).logits[:, :-1, self.columns]  # [B, L-1, V']
        loss, parts = self.loss_fn(s_logits, t_logits if self.distill else None, labels.clamp(min=0), mask)
        if with_agreement:
            same = (s_logits.argmax(-1) == t_logits.argmax(-1)) & mask  # [B, L-1]
            parts = parts | {"agree": same.sum(), "real": mask.sum()}
        return loss, parts

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor):
        """One micro-batch: loss, backward, and (once ``train.grad_accum`` micro-batches are in,
        ``accelerator.sync_gradients``) clip, optimizer and schedule step."""
        acc = self.accelerator
        with acc.accumulate(self.student):
            loss, parts = self.loss_step(self.student, input_ids, labels)
            acc.backward(loss)
            if acc.sync_gradients and self.cfg.optim.grad_clip > 0:
                acc.clip_grad_norm_(self.student.parameters(), self.cfg.optim.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
        return loss, parts

    # ---- evaluation ----------------------------------------------------------------------------

    @torch.no_grad()
    def validate(self) -> dict:
        """Loss and greedy agreement with the target (teacher-forced argmax) on held-out rows."""
        model, dev, bs = self.accelerator.unwrap_model(self.student), self.accelerator.device, self.cfg.train.batch_size
        losses, agree, real = [], 0, 0
        for i in range(0, len(self.val_ids), bs):
            loss, parts = self.loss_step(model, self.val_ids[i : i + bs].to(dev), self.val_labels[i : i + bs].to(dev), True)
            losses.append(loss.item())
            agree, real = agree + int(parts["agree"]), real + int(parts["real"])
        return {"val_loss": sum(losses) / len(losses), "val_agreement": agree / max(real, 1)}

    def evaluate(self, label: str) -> dict:
        """Held-out acceptance and speed of the student as a draft, with Choral's engine, plus
        ``validate()``."""
        cfg = self.cfg
        result = measure(self.teacher, eval_model(self.accelerator.unwrap_model(self.student)), self.tokenizer, self.eval_prompts,
                         cfg.eval.engine, max_new_tokens=cfg.eval.max_new_tokens)  # fmt: skip
        result.pop("token_ids")
        return result | {"label": label} | self.validate()

    def measure_target_alone(self) -> dict:
        """The target alone on the held-out prompts, with the evaluation's engine settings."""
        return measure(self.teacher, None, self.tokenizer, self.eval_prompts, self.cfg.eval.engine,
                       max_new_tokens=self.cfg.eval.max_new_tokens)  # fmt: skip

    def _evaluate_untrained(self) -> None:
        """The target alone and the untrained student (main process, first run only). The untrained
        student is the first best/ candidate: a short or bad run can make a draft worse."""
        if not self.is_main:
            return
        progress = self.progress
        if "before" not in progress:
            progress["target_alone"] = {k: v for k, v in self.measure_target_alone().items() if k != "token_ids"}
            progress["before"] = self.evaluate("before training")
            progress["student_params"] = self.student_params
            progress["trainable_params"] = sum(p.numel() for p in self.student.parameters() if p.requires_grad)
        if "best_step" not in progress:
            progress["best_acceptance"], progress["best_step"] = progress["before"]["acceptance_rate"], 0
            self.save_model("best")

    # ---- checkpoints ---------------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        """The resumable last/ (accelerate's state and progress.json), swapped in atomically."""
        acc, main = self.accelerator, self.is_main
        # Every process writes its part of the state into one shared temporary folder, then the
        # main process swaps it in with a rename.
        tmp = self.out_dir / f".last.step{self.progress['step']}"
        if main:
            shutil.rmtree(tmp, ignore_errors=True)  # a killed run's leftover must not join this manifest
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp / "state"))
        acc.wait_for_everyone()
        if main:
            write_json_atomic(tmp / "progress.json", self.progress)
            write_manifest(tmp)  # last: it covers every file above
            if self.cfg.output.keep_previous:
                keep_previous(self.out_dir / "last")
            with atomic_dir(self.out_dir / "last", tmp=tmp):
                pass
        acc.wait_for_everyone()

    def save_model(self, name: str) -> None:
        """The student as a plain Hugging Face folder (adapters merged) with the tokenizer: best/ or final/."""
        with atomic_dir(self.out_dir / name) as tmp:
            plain_model(self.accelerator.unwrap_model(self.student)).save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            write_manifest(tmp)
        release_host_memory()  # serialization buffers: the size of the student

    # ---- the loop ------------------------------------------------------------------------------

    def train(self) -> dict:
        """Optimizer steps until ``train.max_steps`` or the time budget; returns ``progress``."""
        cfg, acc, progress = self.cfg, self.accelerator, self.progress
        self._evaluate_untrained()
        started = time.perf_counter()
        step0, tokens0 = progress["step"], progress["tokens"]
        bar = tqdm(total=cfg.train.max_steps, initial=progress["step"], desc="train-draft", disable=not self.is_main)
        out_of_time = False
        batches_per_epoch = len(self.loader)
        while progress["step"] < cfg.train.max_steps:
            # A resumed run skips the batches of this epoch it already trained on, so it sees the
            # batches an uninterrupted run would.
            skip = (progress["step"] * cfg.train.grad_accum) % batches_per_epoch
            epoch_loader = acc.skip_first_batches(self.loader, skip) if skip else self.loader
            for input_ids, labels in epoch_loader:
                loss, parts = self.step(input_ids, labels)
                if not acc.sync_gradients:
                    continue
                progress["step"] += 1
                progress["tokens"] += input_ids.numel() * acc.num_processes * cfg.train.grad_accum
                step = progress["step"]
                elapsed = time.perf_counter() - started
                if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
                    value = loss.detach().item()
                    entry = {"step": step, "loss": value, "lr": self.scheduler.get_last_lr()[0]} | {k: float(v) for k, v in parts.items()}
                    progress["history"].append(entry)
                    bar.set_postfix(loss=f"{value:.4f}", tok_s=f"{(progress['tokens'] - tokens0) / elapsed:.0f}")
                bar.update(1)
                # Stop after the last step that fits: one more at the mean pace would overrun the budget.
                # (Stopping only once past it ran an extra step and evaluated again one step after an
                # `eval.every` evaluation.)
                pace = elapsed / (step - step0)
                out_of_time = cfg.train.time_budget_min is not None and elapsed + pace > 60 * cfg.train.time_budget_min
                last_step = step == cfg.train.max_steps or out_of_time
                if self.is_main and (step % cfg.eval.every == 0 or last_step):
                    self._record_evaluation(step)
                if step % cfg.output.save_every == 0 or last_step:
                    self.save_checkpoint()
                if last_step:
                    break
            if out_of_time:
                break
        bar.close()
        if self.is_main:
            self._write_results(time.perf_counter() - started, progress["step"] - step0)
        return progress

    def _record_evaluation(self, step: int) -> None:
        """Evaluate at ``step``, add it to the history, and keep the student as best/ if it leads."""
        result = self.evaluate(f"step {step}") | {"step": step}
        self.progress["history"].append(result)
        if result["acceptance_rate"] > self.progress["best_acceptance"]:
            self.progress["best_acceptance"] = result["acceptance_rate"]
            self.progress["best_step"] = step
            self.save_model("best")

    def _write_results(self, seconds: float, steps: int) -> None:
        """final/, metrics.json, training.png and the printed summary (main process)."""
        progress = self.progress
        self.save_model("final")  # the student as trained, whatever best/ chose (for comparisons and ablations)
        progress["after"] = next(h for h in reversed(progress["history"]) if "acceptance_rate" in h)
        progress["train_seconds"] = seconds
        progress["steps_this_run"] = steps
        write_json_atomic(self.out_dir / "metrics.json", progress)
        log_run(self.cfg, progress)  # the same record to W&B when output.wandb asks for it
        plot_history(progress["history"], self.out_dir / "training.png")
        print_summary(progress)

    def cleanup(self) -> None:
        """No process leaves before the main one has written final/ and metrics.json."""
        self.accelerator.wait_for_everyone()


def print_summary(progress: dict) -> None:
    alone = progress["target_alone"]["tokens_per_second"]
    print("\n| student | held-out acceptance | tokens per target call | tokens/s | speedup over target alone |")
    print("|---|---|---|---|---|")
    for key in ("before", "after"):
        r = progress[key]
        print(f"| {r['label']} | {r['acceptance_rate']:.3f} | {r['tokens_per_target_call']:.2f} | "
              f"{r['tokens_per_second']:.2f} | {r['tokens_per_second'] / alone:.2f}x |")  # fmt: skip
    print(f"target alone: {alone:.2f} tokens/s; best acceptance {progress['best_acceptance']:.3f} at step "
          f"{progress.get('best_step')}; student {progress['student_params'] / 1e6:.1f}M parameters")  # fmt: skip
