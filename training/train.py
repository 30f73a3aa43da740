"""The ``train-draft`` loop: fine-tune (cross-entropy) or distill a draft from the target.

An explicit loop in the style of torchtune's knowledge-distillation recipe, no Trainer:

    for each optimizer step:
        1. teacher logits under no_grad (skipped when fine-tuning with cross-entropy only)
        2. student logits, loss over real tokens (serving the loss module of training/losses.py)
        3. backward, clip, optimizer and LR schedule step (accelerate handles devices, processes,
           gradient accumulation and bf16 autocast)
        4. every ``eval.every`` steps: held-out acceptance measured with Choral's engine; the best
           student is saved in Hugging Face format (best/)
        5. every ``output.save_every`` steps: a resumable state (last/), written atomically

Run it on one process or with ``accelerate launch --num_processes N -m training.cli ...``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from serving.config import to_dict
from serving.engine import Request
from serving.models import check_same_tokenizer, eos_token_ids, load_model, load_tokenizer
from serving.prompts import EVAL_ROWS, encode_prompt, load_prompts
from training import data as data_mod
from training.checkpoint import atomic_dir, atomic_file, read_progress, write_json_atomic
from training.config import TrainDraftConfig
from training.evaluate import held_out_prompts, measure
from training.exercises import write_exercises
from training.generate import target_generate
from training.losses import DistillLoss
from training.students import add_lora, count_parameters, derive_student, frequent_tokens, plain_model, reduce_vocab, untie_head


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
    heads = lambda docs: ["\n".join(t.splitlines()[:12]) for t in docs]  # noqa: E731
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
    with atomic_file(cache) as tmp:  # an interrupted run never leaves half a cache
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


def train(cfg: TrainDraftConfig, *, resume: bool = False) -> dict:
    cpu = cfg.train.device == "cpu"
    accelerator = Accelerator(
        mixed_precision=cfg.train.mixed_precision, gradient_accumulation_steps=cfg.train.grad_accum, cpu=cpu
    )
    set_seed(cfg.train.seed)
    out_dir = Path(cfg.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    main = accelerator.is_main_process

    tokenizer = load_tokenizer(cfg.model.target)
    check_same_tokenizer(tokenizer, load_tokenizer(cfg.model.student), draft_name=f"student {cfg.model.student!r}")
    distill = cfg.loss.kind != "ce" and cfg.loss.ce_ratio < 1.0  # the teacher's logits carry weight
    teacher = load_model(cfg.model.target, dtype=cfg.model.dtype, device=accelerator.device)
    student = build_student(cfg, accelerator.device)
    vocab = min(teacher.get_output_embeddings().weight.shape[0], student.get_output_embeddings().weight.shape[0])

    ids, labels, text_ids = build_rows(cfg, tokenizer, teacher, out_dir)
    if cfg.model.draft_vocab is not None:
        # Counted over all the domain text read (not just the rows trained on, which may hold fewer
        # distinct tokens than the head keeps), so runs over the same text get the same head.
        source = text_ids if len(text_ids) else labels
        reduce_vocab(student, frequent_tokens(source, cfg.model.draft_vocab, always=eos_token_ids(teacher, tokenizer)))
    student_params = count_parameters(student)  # before adapters: the plain model that is saved and served
    if cfg.model.lora_rank:
        student = add_lora(student, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_targets)
    train_idx, val_idx = data_mod.split_train_val(list(range(len(ids))), cfg.data.val_fraction, cfg.train.seed)
    train_rows = TensorDataset(ids[train_idx], labels[train_idx])
    val_ids, val_labels = ids[val_idx], labels[val_idx]
    loader = DataLoader(
        train_rows, batch_size=cfg.train.batch_size, shuffle=True, drop_last=True,
        generator=torch.Generator().manual_seed(cfg.train.seed),
    )  # fmt: skip
    if len(loader) == 0:
        raise ValueError(f"{len(train_idx)} training rows < batch_size={cfg.train.batch_size}: lower train.batch_size")
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    student, optimizer, loader, scheduler = accelerator.prepare(student, optimizer, loader, scheduler)
    loss_fn = DistillLoss(cfg.loss.kind, ce_ratio=cfg.loss.ce_ratio, temperature=cfg.loss.temperature, beta=cfg.loss.beta)

    progress = {"step": 0, "tokens": 0, "best_acceptance": -1.0, "history": [], "config": to_dict(cfg)}
    if resume and (saved := read_progress(out_dir)) is not None:
        accelerator.load_state(str(out_dir / "last" / "state"))
        progress = saved
        accelerator.print(f"resumed from step {progress['step']} ({out_dir / 'last'})")

    eval_prompts = held_out_prompts(cfg.data.domain, cfg.eval.prompts, tokenizer)
    # The columns the loss sees: every token, or (loss.draft_vocab_only) the draft's own, which
    # is the distribution a reduced draft is served with; labels outside them are not trained on.
    columns, column_of = slice(0, vocab), None
    if cfg.loss.draft_vocab_only:
        columns = torch.tensor(accelerator.unwrap_model(student).config.draft_vocab, device=accelerator.device)
        column_of = torch.full((vocab,), -100, dtype=torch.long, device=accelerator.device)  # token id -> column
        column_of[columns] = torch.arange(len(columns), device=accelerator.device)

    def step_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, with_agreement: bool = False):
        labels = labels[:, 1:]  # [B, L-1] next-token targets, -100 on padding
        if column_of is not None:
            labels = torch.where(labels >= 0, column_of[labels.clamp(min=0)], labels)
        mask = labels != -100
        s_logits = model(input_ids=input_ids).logits[:, :-1, columns]  # [B, L-1, V']
        t_logits = None
        if distill or with_agreement:
            with torch.no_grad(), accelerator.autocast():  # bf16 like the student under mixed_precision
                t_logits = teacher(input_ids=input_ids).logits[:, :-1, columns]  # [B, L-1, V']
        loss, parts = loss_fn(s_logits, t_logits if distill else None, labels.clamp(min=0), mask)
        if with_agreement:
            same = (s_logits.argmax(-1) == t_logits.argmax(-1)) & mask
            parts = parts | {"agree": same.sum(), "real": mask.sum()}
        return loss, parts

    @torch.no_grad()
    def validation() -> dict:
        """Loss and greedy agreement with the target (teacher-forced argmax) on held-out rows."""
        model, dev, bs = accelerator.unwrap_model(student), accelerator.device, cfg.train.batch_size
        losses, agree, real = [], 0, 0
        for i in range(0, len(val_ids), bs):
            loss, parts = step_loss(model, val_ids[i : i + bs].to(dev), val_labels[i : i + bs].to(dev), True)
            losses.append(loss.item())
            agree, real = agree + int(parts["agree"]), real + int(parts["real"])
        return {"val_loss": sum(losses) / len(losses), "val_agreement": agree / max(real, 1)}

    def evaluate(label: str) -> dict:
        result = measure(teacher, plain_model(accelerator.unwrap_model(student)), tokenizer, eval_prompts,
                         k=cfg.eval.k, max_new_tokens=cfg.eval.max_new_tokens, draft_weights=cfg.eval.draft_weights)  # fmt: skip
        result.pop("token_ids")
        return result | {"label": label} | validation()

    if main and "before" not in progress:
        progress["target_alone"] = {k: v for k, v in measure(teacher, None, tokenizer, eval_prompts, max_new_tokens=cfg.eval.max_new_tokens, draft_weights=cfg.eval.draft_weights).items() if k != "token_ids"}
        progress["before"] = evaluate("before training")
        progress["student_params"] = student_params
        progress["trainable_params"] = sum(p.numel() for p in student.parameters() if p.requires_grad)

    def save_last() -> None:
        # Every process writes its part of the state into one shared temporary folder, then the
        # main process swaps it in with a rename.
        tmp = out_dir / f".last.step{progress['step']}"
        if main:
            tmp.mkdir(parents=True, exist_ok=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp / "state"))
        accelerator.wait_for_everyone()
        if main:
            write_json_atomic(tmp / "progress.json", progress)
            with atomic_dir(out_dir / "last", tmp=tmp):
                pass
        accelerator.wait_for_everyone()

    def save_hf(name: str) -> None:
        with atomic_dir(out_dir / name) as tmp:
            plain_model(accelerator.unwrap_model(student)).save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)


    if main and "best_step" not in progress:
        # The untrained student is a candidate too: a short or bad run can make a draft worse.
        progress["best_acceptance"], progress["best_step"] = progress["before"]["acceptance_rate"], 0
        save_hf("best")

    started = time.perf_counter()
    step0, tokens0 = progress["step"], progress["tokens"]
    bar = tqdm(total=cfg.train.max_steps, initial=progress["step"], desc="train-draft", disable=not main)
    out_of_time = False
    batches_per_epoch = len(loader)
    while progress["step"] < cfg.train.max_steps:
        skip = (progress["step"] * cfg.train.grad_accum) % batches_per_epoch
        epoch_loader = accelerator.skip_first_batches(loader, skip) if skip else loader
        for input_ids, labels in epoch_loader:
            with accelerator.accumulate(student):
                loss, parts = step_loss(student, input_ids, labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.optim.grad_clip > 0:
                    accelerator.clip_grad_norm_(student.parameters(), cfg.optim.grad_clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            progress["step"] += 1
            progress["tokens"] += input_ids.numel() * accelerator.num_processes * cfg.train.grad_accum
            step = progress["step"]
            elapsed = time.perf_counter() - started
            if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
                value = loss.detach().item()
                entry = {"step": step, "loss": value, "lr": scheduler.get_last_lr()[0]} | {k: float(v) for k, v in parts.items()}
                progress["history"].append(entry)
                bar.set_postfix(loss=f"{value:.4f}", tok_s=f"{(progress['tokens'] - tokens0) / elapsed:.0f}")
            bar.update(1)
            # Stop after the last step that fits: one more at the mean pace would overrun the budget.
            # (Stopping only once past it ran an extra step and evaluated again one step after an
            # `eval.every` evaluation.)
            pace = elapsed / (step - step0)
            out_of_time = cfg.train.time_budget_min is not None and elapsed + pace > 60 * cfg.train.time_budget_min
            last_step = step == cfg.train.max_steps or out_of_time
            if main and (step % cfg.eval.every == 0 or last_step):
                result = evaluate(f"step {step}") | {"step": step}
                progress["history"].append(result)
                if result["acceptance_rate"] > progress["best_acceptance"]:
                    progress["best_acceptance"] = result["acceptance_rate"]
                    progress["best_step"] = step
                    save_hf("best")
            if step % cfg.output.save_every == 0 or last_step:
                save_last()
            if last_step:
                break
        if out_of_time:
            break
    bar.close()

    if main:
        save_hf("final")  # the student as trained, whatever best/ chose (for comparisons and ablations)
        progress["after"] = next(h for h in reversed(progress["history"]) if "acceptance_rate" in h)
        progress["train_seconds"] = time.perf_counter() - started
        progress["steps_this_run"] = progress["step"] - step0
        write_json_atomic(out_dir / "metrics.json", progress)
        plot_history(progress["history"], out_dir / "training.png")
        print_summary(progress)
    accelerator.wait_for_everyone()
    return progress


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
