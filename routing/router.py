"""The router: prompt -> which draft (or none) to speculate with, and a suggested K.

    router = Router.load("runs/router/router.pt")
    choice = router.choose("def fibonacci(n):")
    choice.draft                  # a name from router.draft_names; "none" = the target alone
    router.draft_refs[choice.draft], choice.k, choice.predicted_acceptance

A small MLP reads the prompt's features (sentence embedding + cheap statistics, normalised with
the training set's statistics) and predicts each draft's acceptance rate. ``objective:
acceptance`` picks the highest; ``objective: speedup`` turns each prediction into an expected
speedup with the router's cost model (``routing.cost_model``: the drafts' measured costs, the
batch the request joins, the prompt's length) and picks the best, or "none" when no draft beats
the target alone. Why a learned choice: which draft pays depends on the prompt (a copying drafter
on a prompt it can copy from, a draft model on one it was trained for), and the target alone is
the right answer where none does.

``Router.create`` builds an untrained but valid router (random MLP, identity normalisation) from
draft references alone, for tests and for wiring a server up before any data is collected. The
file it lives in is ``routing.router_file``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from routing.cost_model import CostModel
from routing.features import BUNDLED_EMBEDDER, Featurizer
from routing.router_file import FORMAT, FORMAT_VERSION, RouterError, read_router_file, write_router_file

NONE = "none"
OBJECTIVES = ("acceptance", "speedup")
DEFAULT_K_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8)
# An untrained router's guess at draft cost: a draft ~10x smaller than its target.
DEFAULT_COST = {"draft_cost": 0.1, "verify_cost": 1.0}


@dataclass
class Choice:
    draft: str  # a name from Router.draft_names; "none" = the target alone
    predicted_acceptance: dict[str, float]  # per draft name; "none" -> 0.0
    predicted_speedup: dict[str, float]  # per draft name (at its best K), "none" -> 1.0
    k: int  # suggested K for the chosen draft; 0 for "none"
    occupancy: int = 1  # the batch occupancy the choice was made for
    break_even: float = 0.0  # the chosen draft's acceptance rate at K below which it loses to "none"
    expected_rate: float = 0.0  # the chosen draft's predicted acceptance rate at K (accepted / drafted)

    def fallback_floor(self, ratio: float) -> float:
        """The acceptance below which the request should leave its drafter mid-request (once its
        acceptance so far shows it there: ``serving.engine.request.Fallback``): the lower of the
        break-even rate and ``ratio`` of the prediction (so a drafter predicted near break-even is
        not dropped on the first unlucky tokens). 0 for "none"."""
        if self.draft == NONE:
            return 0.0
        return min(self.break_even, ratio * self.expected_rate)


class RouterMLP(nn.Module):
    """features [N, F] -> acceptance logits [N, D], one per draft (sigmoid gives the rate)."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int = 128, layers: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        width = in_dim
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        blocks.append(nn.Linear(width, out_dim))
        self.net = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Router:
    def __init__(
        self,
        *,
        draft_names: list[str],
        draft_refs: dict[str, str | None],
        target_ref: str,
        objective: str,
        embedder: str,
        cheap_features: bool,
        mean: torch.Tensor,
        std: torch.Tensor,
        mlp_config: dict,
        state_dict: dict | None,
        costs: dict[str, dict[str, float]],
        k_buckets: list[int],
        info: dict | None = None,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        """Prefer ``Router.load`` or ``Router.create``; train-router builds one from its results.
        draft_names: all choices, "none" included when it was collected (always under
        ``objective="speedup"``, which can fall back to it). costs: per real draft,
        {"draft_cost": c, "verify_cost": v} relative to a target step (``routing.cost_model``)."""
        self._set_choices(draft_names, draft_refs, objective)
        missing = [n for n in self.drafts if n not in costs]
        if missing:
            raise RouterError(f"drafts {missing} have no measured costs")
        if not k_buckets or min(int(k) for k in k_buckets) < 1:
            raise RouterError(f"k_buckets={k_buckets} must be non-empty positive integers")
        self.target_ref = target_ref
        self.embedder = embedder
        self.cheap_features = cheap_features
        self.cost_model = CostModel(self.drafts, self.draft_refs, costs, k_buckets, dict(info or {}))
        self.device = torch.device(device)
        self.featurizer = Featurizer(embedder, cheap=cheap_features, device=str(self.device))
        self._set_normalisation(mean, std)
        self.mlp_config = dict(mlp_config)
        with torch.random.fork_rng(devices=[]):  # seeds the MLP's init without touching the caller's RNG
            torch.manual_seed(seed)
            self.mlp = RouterMLP(self.featurizer.dim, len(self.drafts), **self.mlp_config)
        if state_dict is not None:
            try:
                self.mlp.load_state_dict(state_dict)
            except RuntimeError as e:
                raise RouterError(f"MLP weights do not match its settings {self.mlp_config}: {e}") from None
        self.mlp.to(self.device).eval()

    def _set_choices(self, draft_names: list[str], draft_refs: dict[str, str | None], objective: str) -> None:
        """The objective, the choices (``draft_names``, "none" added under speedup) and the MLP's
        outputs (``drafts``: the real drafts, in order), each with a model reference."""
        if objective not in OBJECTIVES:
            raise RouterError(f"objective={objective!r} must be one of {', '.join(OBJECTIVES)}")
        self.objective = objective
        self.draft_names = list(draft_names)
        self.drafts = [n for n in self.draft_names if n != NONE]
        if not self.drafts:
            raise RouterError(f"a router needs at least one draft besides {NONE!r}, got {self.draft_names}")
        if len(set(self.draft_names)) != len(self.draft_names):
            raise RouterError(f"draft names repeat: {self.draft_names}")
        if objective == "speedup" and NONE not in self.draft_names:
            self.draft_names.append(NONE)
        self.draft_refs = {n: (None if n == NONE else draft_refs.get(n)) for n in self.draft_names}
        missing = [n for n in self.drafts if not self.draft_refs[n]]
        if missing:
            raise RouterError(f"drafts {missing} have no model reference in draft_refs")

    def _set_normalisation(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """The training features' mean and std [F], checked against the embedder's width."""
        self.mean, self.std = mean.float().to(self.device), std.float().to(self.device)
        if self.mean.shape != (self.featurizer.dim,) or self.std.shape != (self.featurizer.dim,):
            raise RouterError(
                f"normalisation statistics have shape {tuple(self.mean.shape)}/{tuple(self.std.shape)} but "
                f"embedder {self.embedder!r} with cheap_features={self.cheap_features} gives {self.featurizer.dim} "
                "features: the file was made with another embedder"
            )
        if not bool((self.std > 0).all()) or not bool(torch.isfinite(self.mean).all()):
            raise RouterError("normalisation statistics must be finite with std > 0")

    # The costs, K buckets and measurements the router prices with are its cost model's.

    @property
    def costs(self) -> dict[str, dict]:
        return self.cost_model.costs

    @property
    def k_buckets(self) -> list[int]:
        return self.cost_model.k_buckets

    @property
    def info(self) -> dict:
        """router.pt's record of the training (its data, settings and evaluation), and the
        measurements the cost model reads (``collected_k``, ``step_table``, ``step_model``, ``prefill``)."""
        return self.cost_model.info

    @info.setter
    def info(self, value: dict) -> None:
        self.cost_model.info = value

    # ---- building, saving, loading -------------------------------------------------------------

    @classmethod
    def create(
        cls,
        draft_refs: dict[str, str | None],
        target_ref: str,
        embedder: str = BUNDLED_EMBEDDER,
        objective: str = "acceptance",
        seed: int = 0,
        *,
        cheap_features: bool = True,
        hidden: int = 128,
        layers: int = 2,
        costs: dict[str, dict[str, float]] | None = None,
        k_buckets: tuple[int, ...] = DEFAULT_K_BUCKETS,
        device: str = "cpu",
    ) -> "Router":
        """An untrained but valid router: random MLP (seeded), identity normalisation, default
        costs unless given. ``draft_refs``: name -> model reference; a ``"none": None`` entry
        makes the target alone a choice. Its choices are arbitrary until trained; use it to
        build router.pt files for tests or to wire a server before collecting data."""
        names = list(draft_refs)
        costs = costs or {n: dict(DEFAULT_COST) for n in names if n != NONE}
        featurizer = Featurizer(embedder, cheap=cheap_features, device=device)
        return cls(
            draft_names=names,
            draft_refs=draft_refs,
            target_ref=target_ref,
            objective=objective,
            embedder=embedder,
            cheap_features=cheap_features,
            mean=torch.zeros(featurizer.dim),
            std=torch.ones(featurizer.dim),
            mlp_config={"hidden": hidden, "layers": layers, "dropout": 0.0},
            state_dict=None,
            costs=costs,
            k_buckets=list(k_buckets),
            info={"trained": False},
            device=device,
            seed=seed,
        )

    def to_dict(self) -> dict:
        """What router.pt holds (``routing.router_file``)."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "draft_names": list(self.draft_names),
            "draft_refs": dict(self.draft_refs),
            "target_ref": self.target_ref,
            "objective": self.objective,
            "embedder": self.embedder,
            "cheap_features": self.cheap_features,
            "feature_dim": self.featurizer.dim,
            "mean": self.mean.cpu(),
            "std": self.std.cpu(),
            "mlp": dict(self.mlp_config),
            "state_dict": {k: v.detach().cpu() for k, v in self.mlp.state_dict().items()},
            "costs": self.costs,
            "k_buckets": list(self.k_buckets),
            "info": self.info,
        }

    def save(self, path: str | Path) -> None:
        """Write router.pt atomically (a temporary file renamed over ``path``)."""
        write_router_file(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu") -> "Router":
        """Load and validate router.pt (format, version, keys, shapes) and load its embedder, so
        the first ``choose`` is as fast as the rest."""
        path = Path(path)
        data = read_router_file(path)
        try:
            router = cls(
                draft_names=data["draft_names"],
                draft_refs=data["draft_refs"],
                target_ref=data["target_ref"],
                objective=data["objective"],
                embedder=data["embedder"],
                cheap_features=bool(data["cheap_features"]),
                mean=data["mean"],
                std=data["std"],
                mlp_config=data["mlp"],
                state_dict=data["state_dict"],
                costs=data["costs"],
                k_buckets=data["k_buckets"],
                info=data["info"],
                device=device,
            )
        except RouterError as e:
            raise RouterError(f"{path}: {e}") from None
        if router.featurizer.dim != data["feature_dim"]:
            raise RouterError(
                f"{path}: saved for {data['feature_dim']} features but embedder {data['embedder']!r} gives "
                f"{router.featurizer.dim}"
            )
        return router

    # ---- choosing ------------------------------------------------------------------------------

    @torch.inference_mode()
    def predict_acceptance(self, prompts: list[str]) -> torch.Tensor:
        """Predicted acceptance rate [N, D] of each real draft (``self.drafts`` order)."""
        return self.predict_from_features(self.featurizer(prompts))

    @torch.inference_mode()
    def predict_from_features(self, x: torch.Tensor) -> torch.Tensor:
        """Raw (unnormalised) features [N, F] -> predicted acceptance [N, D]."""
        x = (x.to(self.device) - self.mean) / self.std
        return torch.sigmoid(self.mlp(x)).float().cpu()  # [N, D]

    @property
    def collected_k(self) -> int:
        """The K the training rows were collected at: the K its predicted acceptance rates are at."""
        return self.cost_model.collected_k

    def rate_at(self, rate: float, k: int) -> float:
        """A predicted acceptance rate (at the collected K) as the rate it means at K = ``k``: what
        the scheduler expects of a request it runs at another K than the choice's."""
        return self.cost_model.rate_at(rate, k)

    def decide(self, acceptance: torch.Tensor, occupancy: int = 1,
               prompt_tokens: torch.Tensor | Sequence[int] | None = None) -> list[Choice]:  # fmt: skip
        """The choices the objective makes from acceptance rates [N, D] (predicted by the MLP,
        or by anything else: train-router scores its baselines with the same rule), for a batch
        of ``occupancy`` rows; ``prompt_tokens`` [N], the prompts' lengths, price their prefills
        where the router has a prefill model."""
        model = self.cost_model
        speed, best_k = model.speedups(acceptance, occupancy, prompt_tokens)  # [N, D]
        choices = []
        for i in range(acceptance.shape[0]):
            pa = {n: float(acceptance[i, j]) for j, n in enumerate(self.drafts)}
            ps = {n: float(speed[i, j]) for j, n in enumerate(self.drafts)}
            if NONE in self.draft_names:
                pa[NONE], ps[NONE] = 0.0, 1.0
            if self.objective == "acceptance":
                j = int(acceptance[i].argmax())
                draft, k = self.drafts[j], int(best_k[i, j])
            else:  # the target alone unless some draft is predicted to beat it
                j = int(speed[i].argmax())
                draft, k = (self.drafts[j], int(best_k[i, j])) if float(speed[i, j]) > 1.0 else (NONE, 0)
            even = model.break_even(draft, k, occupancy) if draft != NONE else 0.0
            rate = model.rate_at(pa[draft], k) if draft != NONE else 0.0
            choices.append(Choice(draft, pa, ps, k, occupancy, even, rate))
        return choices

    def choose(self, prompt: str, occupancy: int = 1, prompt_tokens: int | None = None) -> Choice:
        return self.choose_batch([prompt], occupancy, None if prompt_tokens is None else [prompt_tokens])[0]

    def choose_batch(self, prompts: list[str], occupancy: int = 1, prompt_tokens: Sequence[int] | None = None) -> list[Choice]:
        """Choices for prompts that join a batch of ``occupancy`` rows (themselves included);
        ``prompt_tokens``: their lengths in the target's tokens (to price the prefills)."""
        if isinstance(prompts, str):
            raise TypeError("choose_batch takes a list of prompts; use choose() for one")
        if occupancy < 1:
            raise ValueError(f"occupancy={occupancy} must be >= 1 (the batch the request joins, itself included)")
        if prompt_tokens is not None and len(prompt_tokens) != len(prompts):
            raise ValueError(f"{len(prompt_tokens)} prompt lengths for {len(prompts)} prompts: pass one length per prompt")
        return self.decide(self.predict_acceptance(list(prompts)), occupancy, prompt_tokens)
