"""Warm-up and timing: compile every step shape, capture CUDA graphs, run each shape once at load,
and time the step's parts for what prices K (``step_k: goodput``, ``auto``).

Every function takes the engine; none changes a row. A step's shapes are the target's verify
widths (``verify_widths``) and each drafter's forward widths, at every batch bucket.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch._inductor.config

from serving.engine.bundled import choral_home
from serving.engine.devices import compile_backend, synchronize
from serving.engine.drafting import distinct
from serving.engine.goodput import RowCosts
from serving.engine.verifier import LocalVerifier

SpeculativeEngine = Any  # serving.engine.core.SpeculativeEngine, which calls these (not imported: it imports this module)


def verify_widths(engine: SpeculativeEngine) -> tuple[int, ...]:
    """Target widths: K+1 per K bucket; a host drafter's short proposal rounds up to a bucket,
    so a fixed k with host drafters may verify any bucket up to it."""
    config = engine.config
    if not engine.drafting:
        return (1,)
    widths = set(config.verify_widths)
    # Proposals of any length up to k_max: host drafters, a request's own K, a goodput cap.
    if any(d.host for d in engine.drafters.values()) or config.request_k_max or config.step_k == "goodput":
        widths |= {1} | {k + 1 for k in config.k_buckets if k <= config.k_max}
    return tuple(sorted(widths))


def enable_compile(engine: SpeculativeEngine, backend: str | None = None) -> None:
    """Compile the draft and verify forwards (the device's backend unless named) and warm every
    shape up now. Compiled graphs are cached on disk by torch (TORCHINDUCTOR_CACHE_DIR, set under
    CHORAL_HOME), so later processes skip most of the compile time."""
    backend = backend or compile_backend(engine.device)
    if backend == "inductor":
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(choral_home() / "compile-cache"))
        # Freezing folds the weights into the graph as constants so the CPU GEMMs use prepacked
        # layouts; inference only, which is all the engine does.
        torch._inductor.config.freezing = True
    drafters = distinct(engine.drafters)
    # Every runner compiles the same method, so its graphs count together against torch's limit:
    # per batch bucket, the target's verify widths and each draft's widths.
    shapes = len(engine.config.batch_buckets) * (len(verify_widths(engine)) + sum(d.forward_shapes for d in drafters))
    engine.verifier.compile(backend, shapes)  # a remote target compiles on its own side
    for drafter in drafters:
        drafter.compile(backend, shapes)
    warmup(engine)


def enable_cuda_graphs(engine: SpeculativeEngine) -> None:
    """Capture every step shape of the target and the model drafts as a CUDA graph now (the
    warm-up's first run of each shape captures it); later steps replay them."""
    engine.verifier.use_cuda_graphs()
    for drafter in distinct(engine.drafters):
        drafter.use_cuda_graphs()
    warmup(engine)


def warmup(engine: SpeculativeEngine) -> None:
    """Run every compiled shape once, at every batch bucket (draft: 1 and 2 tokens; target: K+1
    per K bucket), so the compile cost is paid at load."""
    for rows in engine.config.batch_buckets:
        engine.verifier.warmup(verify_widths(engine), rows)  # a remote target warms itself up
        for drafter in distinct(engine.drafters):
            drafter.warmup(rows)
    synchronize(engine.device)


def fastest_ms(device, run, reps: int) -> float:
    """The fastest of ``reps`` timed calls of ``run``, in ms (the device synchronized after each):
    what the shape costs when nothing else runs."""
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        run()
        synchronize(device)
        times.append(1e3 * (time.perf_counter() - started))
    return min(times)


def time_steps(engine: SpeculativeEngine) -> None:
    """Seed ``engine.step_costs`` with timed forwards (the faster of two) of every verify width
    and of each device drafter's one-token step, at every batch bucket (after a throwaway forward
    per bucket), so step_k goodput prices every width it may choose from the first request on. A
    remote target is timed by its steps only."""
    if not isinstance(engine.verifier, LocalVerifier):
        return
    runners, widths = [d for d in distinct(engine.drafters) if d.owns_rows], verify_widths(engine)

    # The faster of two: one timed forward on a busy 2-core machine was off by 1.5x now and then
    # (always slower), and a cap chosen on such a price costs the whole batch until serving steps
    # correct it.
    def faster_of_two(run) -> float:
        return fastest_ms(engine.device, run, 2)

    for rows in engine.config.batch_buckets:
        engine.verifier.warmup(widths[:1], rows)
        for w in widths:
            engine.step_costs.observe(rows, w, faster_of_two(lambda: engine.verifier.warmup((w,), rows)))
        for runner in runners:
            runner.warmup(rows, (1,))
            engine.step_costs.observe_draft(rows, 1, faster_of_two(lambda: runner.warmup(rows, (1,))))


def row_costs(engine: SpeculativeEngine, models: tuple[str, ...] = (), reps: int = 5) -> RowCosts:
    """One row's step priced by its parts (``RowCosts``, batch 1), timed now: the target's forward
    at every verify width and each named model drafter's forward at its chain and catch-up widths
    (the fastest of ``reps``: what the shape costs when nothing else runs). A remote target is
    priced as a local one of one ms per token, the drafts as measured."""
    from serving.engine.drafters.model import CATCH_UP

    def fastest(run) -> float:
        run()  # a throwaway: the first call of a shape may build it
        return fastest_ms(engine.device, run, reps)

    widths = verify_widths(engine)
    if isinstance(engine.verifier, LocalVerifier):
        verify = [[w, fastest(lambda w=w: engine.verifier.warmup((w,), 1))] for w in widths]
    else:
        verify = [[w, float(w)] for w in widths]
    model = {}
    for name in models:
        runner = engine.drafters[name].runner
        one = [[w, fastest(lambda w=w: runner.warmup((w,), last_only=True, rows=1))] for w in (1, 2)]
        ids = torch.zeros(1, max(CATCH_UP), dtype=torch.long, device=runner.device)
        model[name] = one + [[w, fastest(lambda w=w: runner.extend(ids[:, :w], torch.arange(w, device=runner.device)[None], 0))]
                             for w in CATCH_UP if w <= engine.config.max_len]  # fmt: skip
    return RowCosts(verify=verify, model=model, host={n: 0.02 for n, d in engine.drafters.items() if d.host})
