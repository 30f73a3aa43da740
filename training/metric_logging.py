"""Weights & Biases logging of a train-draft run (``output.wandb``), after torchtune's
``WandBLogger``: the main process logs, the run's folder sits in the run's own folder.

    train-draft --config configs/distill_code.yaml output.wandb=offline   # <output.dir>/wandb/offline-run-*
    wandb sync runs/draft-code-distill/wandb/offline-run-*                  # upload it later, if wanted
    train-draft --config configs/distill_code.yaml output.wandb=online    # needs `wandb login`

The run holds what metrics.json holds, logged when metrics.json is written: every history entry
(training loss, learning rate, loss parts, and each held-out evaluation) at its step, the untrained
student's evaluation at step 0, and the target alone, the best step and the run's size as the
run's summary. Offline (the default way on) needs no account and no network. wandb is the
optional extra ``choral[wandb]``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

MODES = ("off", "offline", "online")


def check_wandb(mode: str) -> None:
    """Refuse a W&B mode that cannot work, before any training happens."""
    if mode not in MODES:
        raise ValueError(f"wandb={mode!r} must be one of {MODES}")
    if mode != "off" and importlib.util.find_spec("wandb") is None:
        raise ValueError(f"wandb={mode} needs the wandb package: pip install 'choral[wandb]' (or set wandb=off)")


def _scalars(entry: dict) -> dict[str, float]:
    return {k: v for k, v in entry.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def log_run(cfg: Any, progress: dict) -> Path | None:
    """Log a finished (or stopped) run's metrics.json record to W&B as ``cfg.output.wandb`` says
    (``cfg``: a ``TrainDraftConfig``); returns the W&B run's folder, or None when logging is off.
    Call it on the main process, where metrics.json is written."""
    out = cfg.output
    if out.wandb == "off":
        return None
    import wandb

    run = wandb.init(
        project=out.wandb_project, name=Path(out.dir).name, dir=out.dir, mode=out.wandb, config=progress.get("config"),
        settings=wandb.Settings(console="off", silent=True),  # the run's own stdout stays the terminal's
    )  # fmt: skip
    try:
        if "before" in progress:
            run.log(_scalars(progress["before"]), step=0)
        for entry in progress["history"]:
            run.log(_scalars(entry), step=entry["step"])
        summary = {f"target_alone/{k}": v for k, v in _scalars(progress.get("target_alone", {})).items()}
        summary |= {k: progress[k] for k in ("best_acceptance", "best_step", "student_params", "trainable_params",
                                             "train_seconds", "tokens") if k in progress}  # fmt: skip
        run.summary.update(summary)
        folder = Path(run.dir).parent  # <output.dir>/wandb/<offline-run-...>; run.dir is its files/
    finally:
        run.finish()
    return folder
