"""train-draft's entry point: the recipe that ``model.kind`` names, set up, run and cleaned up.

The draft-model recipe (``training.train``) and the EAGLE-3 head's (``training.eagle3``, a subclass of
it) both sit below this module, so neither has to import the other back to choose.
"""

from __future__ import annotations

from training.config import TrainDraftConfig


def train(cfg: TrainDraftConfig, *, resume: bool = False) -> dict:
    """Run train-draft (``--resume``: from ``<output.dir>/last`` if it exists); returns the run's
    progress record, which the main process also wrote as metrics.json."""
    if cfg.model.kind == "eagle3":
        from training.eagle3 import Eagle3Recipe as Recipe
    else:
        from training.train import TrainDraftRecipe as Recipe
    recipe = Recipe(cfg)
    recipe.setup(resume=resume)
    progress = recipe.train()
    recipe.cleanup()
    return progress
