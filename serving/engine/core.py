"""The speculative engine: a static batch of slots that requests join and leave between steps.

    engine = build_engine(EngineSettings(max_batch_size=4, k=4), tokenizer, target, {"base": draft_model, "ngram": "ngram"})
    [out] = engine.generate([Request(tokenizer.encode("def add(a, b):"), max_new_tokens=32, drafter="ngram")])
    out.text, out.token_ids, out.stats["acceptance_rate"]

(``build_engine`` is in ``serving.engine.loader``, the one place that constructs the engine; tests
build it directly from stub parts.)

One engine holds a verifier (``serving.engine.verifier``: the target and its KV cache, in this
process or behind gRPC), one static batch and a set of named drafters (``serving.engine.drafters``):
draft models, model-free drafters (``ngram``, ``suffix``, ``prediction``) and ``none``, the target
alone. Each row carries the drafter its request was given. A step (``_step``):

1. draft: every drafter proposes for its own rows (a draft model on the device over its own rows,
   at the smallest batch bucket holding them; a host drafter on the host), padded to the step's K
   bucket with masked slots;
2. verify: the verifier runs one target forward over every row (a ``none`` row verifies a single
   token) and
3. accepts or rejects each row's proposal (``serving.engine.acceptance``), drawing the correction
   or bonus token;
4. commit the answer into the decode state (``commit``), then read back one small tensor: the
   step's single host sync.

The host then applies stop strings, retires finished requests and admits waiting ones into free
slots, so ``generate`` already batches continuously. A step runs at the smallest batch bucket that
holds the occupied slots (requests take the lowest free slot), so a lone request does not pay for
the whole static batch.

A server drives the same loop itself, as with vLLM's ``LLMEngine``: ``add_request`` queues,
``step`` admits and advances everyone by one speculative step and returns each request's new
tokens, ``abort_request`` frees a slot. The engine is not thread-safe: call it from one thread.

Everything the engine needs from the target goes through its ``Verifier``: ``prefill`` a row,
``verify`` a step's rows, ``release`` a row. A target model given to the engine is wrapped in a
``LocalVerifier``; ``serving.distributed.remote.RemoteVerifier`` verifies on a target service, and
the engine stays the same (slots, seeds, drafting, stop strings, stats, retirement). When the
verifier fails rows (``VerifierError``: a remote target went away), ``step`` drops their requests,
raises the error naming them, and hands out the other requests' tokens on the next step.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch._inductor.config
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from serving.engine.bundled import choral_home
from serving.engine.devices import compile_backend, synchronize
from serving.engine.drafters.base import (NONE, PREDICTION, BatchDrafter, DraftBatch, Drafter, HostDrafter, Proposal,
                                          RoutingDrafter, RowContext)
from serving.engine.drafters.model import ModelDrafter
from serving.engine.drafters.prediction import PredictionDrafter
from serving.engine.engine_settings import EngineConfig
from serving.engine.goodput import RowCosts, StepCosts, expected_from_counts, per_token_acceptance, plan_cap
from serving.engine.request import (
    TARGET_ORIGIN, Completion, Request, RequestFailed, StepOutput, TokenOrigin, describe_errors, step_origins,
)
from serving.engine.sampling import SamplingParams, SamplingTensors
from serving.engine.speculative import DecodeState, StepRandom, commit, start_row, step_uniforms
from serving.engine.stats import RequestStats
from serving.engine.verifier import LocalVerifier, Verifier, VerifierError, VerifyBatch

log = logging.getLogger(__name__)

PRIOR_A = 0.5  # a row's per-token acceptance before it has drafted, without a router's prediction


@dataclass
class _Slot:
    index: int  # the request id from add_request
    request: Request
    prompt_len: int
    generator: torch.Generator
    generated: list[int]
    origins: list[TokenOrigin]  # [len(generated)]: how each generated token came
    stats: RequestStats
    started: float
    drafter: str  # the name of the drafter the request drafts with ("none": the target alone)
    k_value: float = 0.0  # this request's own K ("auto" moves it by the request's own acceptance)
    emitted: int = 0  # tokens of ``generated`` already handed out by step()
    fell_back_at: int | None = None  # tokens generated when the row switched to the target alone
    routed_drafter: str | None = None  # the drafter the request started with, when it fell back
    prior_a: float = PRIOR_A  # per-token acceptance expected before the row's own record (step_k goodput)


Drafters = Mapping[str, "PreTrainedModel | Drafter | None"]


def _drafters(draft: PreTrainedModel | None, drafters: Drafters | None) -> Drafters:
    if draft is not None and drafters is not None:
        raise ValueError("give either draft (one draft model) or drafters (name -> drafter), not both")
    if drafters is not None:
        return drafters
    return {"draft": draft} if draft is not None else {}


class SpeculativeEngine:
    def __init__(
        self,
        target: PreTrainedModel | Verifier,
        tokenizer: PreTrainedTokenizerBase,
        draft: PreTrainedModel | None = None,
        config: EngineConfig | None = None,
        *,
        drafters: Drafters | None = None,
        default_drafter: str | None = None,
    ) -> None:
        """``target``: the target model (run here, in a ``LocalVerifier``) or a ``Verifier``.
        ``drafters``: name -> a draft model (on the target's tokenizer), a ``HostDrafter``, or
        None (another name for the target alone). ``draft`` is shorthand for ``{"draft": draft}``.
        ``none`` always exists, ``prediction`` wherever there is another drafter.
        ``default_drafter``: for requests that name none (default: the first of ``drafters``, else
        ``none``)."""
        config = config or EngineConfig()
        drafters = _drafters(draft, drafters)
        self.verifier = target if isinstance(target, Verifier) else LocalVerifier(target, tokenizer)
        self.verifier.bind(config)  # fills in config.max_len
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = self.verifier.vocab_size
        self.drafters = self._bind_drafters(drafters)
        # The decode state lives where the target reads it, else with the drafts (a remote target).
        models = [d for d in self.drafters.values() if isinstance(d, ModelDrafter)]
        self.device = self.verifier.device or (models[0].device if models else torch.device("cpu"))
        self.drafter_names = [*[n for n in drafters if n in self.drafters],
                              *[n for n in (PREDICTION,) if n in self.drafters and n not in drafters], NONE]  # fmt: skip
        self.default_drafter = default_drafter or next((n for n in drafters if n in self.drafters), NONE)
        if self.default_drafter not in self.drafter_names:
            raise ValueError(f"default_drafter={self.default_drafter!r} is not one of {self.drafter_names}")
        B = config.max_batch_size
        k_max = config.k_max if self.drafting else 0
        if self.verifier.k_max is not None and k_max > self.verifier.k_max:
            raise ValueError(f"k up to {k_max} but {self.verifier.name} verifies K <= {self.verifier.k_max}")
        self.state = DecodeState(
            tokens=torch.zeros(B, config.max_len + k_max + 1, dtype=torch.long, device=self.device),
            # Empty slots look like finished two-token rows, so every gather stays in range.
            lengths=torch.full((B,), 2, dtype=torch.long, device=self.device),
            limits=torch.full((B,), 2, dtype=torch.long, device=self.device),
            done=torch.ones(B, dtype=torch.bool, device=self.device),
            eos_ids=torch.tensor(self.verifier.eos_ids, dtype=torch.long, device=self.device),
        )
        self._eos = set(self.state.eos_ids.tolist())
        self._sampling: SamplingTensors | None = None  # rebuilt when a slot's request or the bucket changes
        # Where each request's K starts; with "auto" every request then moves its own K, so its
        # output never depends on what else shares the batch.
        self._k_start = float(config.k_buckets[len(config.k_buckets) // 2] if config.k == "auto" else config.k)
        self._slots: list[_Slot | None] = [None] * B
        self._waiting: deque[tuple[int, Request]] = deque()
        self._carry: list[StepOutput] = []  # outputs of a step that raised, handed out by the next one
        self._next_id = 0
        # Measured step times by (rows, width): what step_k goodput prices a step with; a profiled
        # table (``StepCosts.table``, the router's step_table when serving) stands in until measured.
        self.step_costs = StepCosts()
        self._model_draft = (0.0, 0)  # this step's draft-model time (s) and forwards
        if config.compile_backend is not None:
            self.enable_compile(config.compile_backend)
        if config.cuda_graphs:
            self.enable_cuda_graphs()
        if config.step_k == "goodput" and self.drafting:
            self.time_steps()
        self._choices: dict[int, str] = {}  # row -> the drafter whose proposal this step verifies
        for routing in self._distinct(RoutingDrafter):
            routing.price(self.row_costs(routing.model_costs_needed), self._verify_widths())

    def _bind_drafters(self, given: Drafters) -> dict[str, Drafter]:
        """The engine's drafters by name, bound to its shapes: a draft model becomes a
        ``ModelDrafter`` (one per distinct model: two names for one model share its cache, since a
        row drafts with one name only); None names the target alone and is left out, as is every
        drafter of an engine with k=0 (the target alone, whatever it was given). An engine that
        drafts also takes predictions (``prediction``, default settings unless given)."""
        if self.config.k == 0:
            return {}
        wrapped: dict[int, Drafter] = {}
        out: dict[str, Drafter] = {}
        for name, d in given.items():
            if d is None:
                continue
            if id(d) not in wrapped:
                wrapped[id(d)] = d if isinstance(d, Drafter) else ModelDrafter(d)
            out[name] = wrapped[id(d)]
        if out:
            out.setdefault(PREDICTION, PredictionDrafter())
        layers = {tuple(d.target_layers) for d in out.values() if d.target_layers}
        if len(layers) > 1:
            raise ValueError(f"drafters read the target's features of different layers {sorted(layers)}: one engine "
                             "captures one set; give its drafters the same eagle_aux_hidden_state_layer_ids")  # fmt: skip
        self.feature_layers = layers.pop() if layers else ()
        if self.feature_layers:  # EAGLE-3 heads: the verifier hands out the target's features
            self.verifier.capture(self.feature_layers)
        for d in {id(d): d for d in out.values()}.values():
            if isinstance(d, RoutingDrafter):  # auto: drafts with the others
                d.attach(out)
            d.bind(batch_size=self.config.max_batch_size, max_len=self.config.max_len, vocab_size=self.vocab_size)
        return out

    @property
    def drafting(self) -> bool:
        """Whether any request can draft (else every step verifies one token per row)."""
        return bool(self.drafters)

    def _distinct(self, kind: type = Drafter) -> list[Drafter]:
        """Each drafter of ``kind`` once (two names may share one)."""
        return [d for d in {id(d): d for d in self.drafters.values()}.values() if isinstance(d, kind)]

    # ---- public API ----------------------------------------------------------------------------

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Decode all requests, B at a time, admitting each as a slot frees up."""
        for r in requests:
            self._check_fits(r)
        ids = [self.add_request(r) for r in requests]
        results: dict[int, Completion] = {}
        try:
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.finished is not None:
                        results[out.request_id] = out.finished
        except BaseException:
            for i in ids:  # leave the engine clean for the next caller
                self.abort_request(i)
            raise
        return [results[i] for i in ids]

    def add_request(self, request: Request) -> int:
        """Queue a request (checked now: a prompt that cannot fit raises ``ValueError``) and return
        its id; ``step`` admits it when a slot is free. The incremental API follows vLLM's
        ``LLMEngine`` (add_request / step / abort_request / has_unfinished_requests)."""
        self._check_fits(request)
        request_id = self._next_id
        self._next_id += 1
        self._waiting.append((request_id, request))
        return request_id

    def abort_request(self, request_id: int) -> bool:
        """Drop a waiting or running request (e.g. its client went away) and free its slot.
        Returns whether it was found."""
        for i, (rid, _) in enumerate(self._waiting):
            if rid == request_id:
                del self._waiting[i]
                return True
        for b, slot in enumerate(self._slots):
            if slot is not None and slot.index == request_id:
                self._slots[b] = None
                self.state.done[b] = True
                self._sampling = None
                self._stop_drafter(b, slot, finished=False)
                self.verifier.release(b)
                return True
        return False

    def has_unfinished_requests(self) -> bool:
        # Outputs carried over from a step that raised (possibly a finished one) still need a step
        # to be handed out, even when no slot is running any more.
        return bool(self._carry) or bool(self._waiting) or any(s is not None for s in self._slots)

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def step(self) -> list[StepOutput]:
        """Admit waiting requests into free slots (prefill + first token), then run one
        speculative step over all slots. Returns, per request that advanced, its new tokens and,
        on the step it finished, its ``Completion``. If the verifier fails requests
        (``VerifierError``), they are dropped and the error is raised with their ids in
        ``request_ids``; the other requests' outputs of this step come with the next one.
        A request whose admission or step raised anything else fails alone (``RequestFailed``,
        raised the same way): the others' outputs are unchanged by it."""
        outputs, self._carry = self._carry, []
        try:
            self._advance(outputs)
        except VerifierError as e:
            rows = [b for b, s in enumerate(self._slots) if s is not None] if e.rows is None else e.rows
            e.request_ids += self._fail(rows)
            self._carry = [o for o in outputs if o.request_id not in e.request_ids]
            raise
        except RequestFailed as e:
            self._carry = [o for o in outputs if o.request_id not in e.request_ids]
            raise
        return outputs

    def close(self) -> None:
        """Abort every request and close the verifier (a remote one's connection)."""
        for slot in [s for s in self._slots if s is not None]:
            self.abort_request(slot.index)
        self._waiting.clear()
        self.verifier.close()

    def _advance(self, outputs: list[StepOutput]) -> None:
        """The body of ``step``, appending to ``outputs`` as it goes so that what was produced
        before a ``VerifierError`` is still handed out."""
        slots = self._slots
        broken: dict[int, BaseException] = {}  # request id -> what failed it alone
        for b in range(len(slots)):
            while slots[b] is None and self._waiting:
                request_id, request = self._waiting.popleft()
                try:
                    admitted = self._admit(b, request_id, request)
                except VerifierError:
                    raise
                except Exception as e:  # this request alone: its prefill, drafter or stop check
                    self._unadmit(b)
                    broken[request_id] = e
                    continue
                if admitted is None:  # the target has no room now: retry on a later step
                    self._waiting.appendleft((request_id, request))
                    break
                slots[b], finished = admitted
                outputs.append(self._emit(b, finished))
        if any(s is not None for s in slots):
            finished, failed = self._step_or_isolate(slots, broken)
            lost = failed.rows if failed is not None else ()
            for b, slot in enumerate(slots):
                if slot is not None and b not in lost:
                    outputs.append(self._emit(b, b in finished))
            if failed is not None:  # the target lost these rows: step() fails their requests
                if broken:
                    log.error("requests %s failed alone: %s", sorted(broken), describe_errors(broken))
                raise failed
        if broken:
            raise RequestFailed(broken)

    def _step_or_isolate(
        self, slots: list[_Slot | None], broken: dict[int, BaseException]
    ) -> tuple[list[int], VerifierError | None]:
        """``_step`` over every running slot. If it raises (anything but the verifier's error),
        nothing was committed: each row then runs the step alone, from the random state it had
        before, and only the rows that raise again fail (into ``broken``); the others advance
        exactly as they would have in the batch (the kernels are batch-invariant, and every row
        draws from its own generator)."""
        before = {b: s.generator.get_state() for b, s in enumerate(slots) if s is not None}
        try:
            return self._step(slots)
        except VerifierError:
            raise
        except _Committed as e:  # rows failed after the commit: the others' step stands
            for b, error in e.rows.items():
                broken[slots[b].index] = error
            self._fail(list(e.rows))
            return e.finished, e.failed
        except Exception as e:
            if len(before) == 1:
                [b] = before
                broken[slots[b].index] = e
                self._fail([b])
                return [], None
            first = e
        log.warning("a step over rows %s raised %s: %s; running each row alone", sorted(before), type(first).__name__, first)
        finished, failed_rows, failed = [], [], None
        done = self.state.done.clone()  # [B] the running rows' flags; each lone run updates its own
        try:
            for b in before:
                self.state.done.fill_(True)  # the other rows sit this run out: nothing of theirs moves
                self.state.done[b] = done[b]
                slots[b].generator.set_state(before[b])
                self._sampling = None
                try:
                    f, v = self._step([slot if i == b else None for i, slot in enumerate(slots)])
                    finished += f
                    if v is not None:
                        failed = failed or v
                        failed.rows = sorted({*(failed.rows or []), *(v.rows or [b])})
                except _Committed as c:
                    failed_rows.append(b)
                    broken[slots[b].index] = c.rows[b]
                except VerifierError:
                    raise
                except Exception as lone:
                    failed_rows.append(b)
                    broken[slots[b].index] = lone
                done[b] = self.state.done[b]
        finally:
            self.state.done.copy_(done)
        self._sampling = None
        self._fail(failed_rows)
        return [b for b in finished if b not in failed_rows], failed

    def _unadmit(self, b: int) -> None:
        """Undo what a failed admission into slot ``b`` may have set up (no slot was made)."""
        self.state.done[b] = True
        for drafter in self._distinct():
            try:
                drafter.stop(b, finished=False)
            except Exception:  # a drafter that never started this row
                pass
        self.verifier.forget(b)
        self.verifier.release(b)
        self._sampling = None

    def enable_compile(self, backend: str | None = None) -> None:
        """Compile the draft and verify forwards (the device's backend unless named) and warm
        every shape up now. Compiled graphs are cached on disk by torch (TORCHINDUCTOR_CACHE_DIR,
        set under CHORAL_HOME), so later processes skip most of the compile time."""
        backend = backend or compile_backend(self.device)
        if backend == "inductor":
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(choral_home() / "compile-cache"))
            # Freezing folds the weights into the graph as constants so the CPU GEMMs use
            # prepacked layouts; inference only, which is all the engine does.
            torch._inductor.config.freezing = True
        drafters = self._distinct()
        # Every runner compiles the same method, so its graphs count together against torch's limit:
        # per batch bucket, the target's verify widths and each draft's widths.
        shapes = len(self.config.batch_buckets) * (len(self._verify_widths()) + sum(d.forward_shapes for d in drafters))
        self.verifier.compile(backend, shapes)  # a remote target compiles on its own side
        for drafter in drafters:
            drafter.compile(backend, shapes)
        self.warmup()

    def enable_cuda_graphs(self) -> None:
        """Capture every step shape of the target and the model drafts as a CUDA graph now (the
        warm-up's first run of each shape captures it); later steps replay them."""
        self.verifier.use_cuda_graphs()
        for drafter in self._distinct():
            drafter.use_cuda_graphs()
        self.warmup()

    def warmup(self) -> None:
        """Run every compiled shape once, at every batch bucket (draft: 1 and 2 tokens; target: K+1
        per K bucket) so the compile cost is paid at load; with the on-disk compile cache later
        loads are quick."""
        for rows in self.config.batch_buckets:
            self.verifier.warmup(self._verify_widths(), rows)  # a remote target warms itself up
            for drafter in self._distinct():
                drafter.warmup(rows)
        synchronize(self.device)

    def time_steps(self) -> None:
        """Seed ``step_costs`` with one timed forward of every verify width and of each draft
        model's one-token step, at every batch bucket (after a throwaway forward per bucket), so
        step_k goodput prices every width it may choose from the first request on. A remote
        target is timed by its steps only."""
        if not isinstance(self.verifier, LocalVerifier):
            return
        runners, widths = self._distinct(BatchDrafter), self._verify_widths()
        for rows in self.config.batch_buckets:
            self.verifier.warmup(widths[:1], rows)
            for w in widths:
                started = time.perf_counter()
                self.verifier.warmup((w,), rows)
                synchronize(self.device)
                self.step_costs.observe(rows, w, 1e3 * (time.perf_counter() - started))
            for runner in runners:
                runner.warmup(rows, (1,))
                started = time.perf_counter()
                runner.warmup(rows, (1,))
                synchronize(self.device)
                self.step_costs.observe_draft(rows, 1, 1e3 * (time.perf_counter() - started))

    def row_costs(self, models: tuple[str, ...] = (), reps: int = 5) -> RowCosts:
        """One row's step priced by its parts (``RowCosts``, batch 1), timed now: the target's
        forward at every verify width and each named model drafter's forward at its chain and
        catch-up widths (the fastest of ``reps``: what the shape costs when nothing else runs). A remote target is priced as a local one of one
        ms per token, the drafts as measured (a remote verify is timed by its steps only)."""
        from serving.engine.drafters.model import CATCH_UP

        def fastest_ms(run) -> float:
            run()  # a throwaway: the first call of a shape may build it
            times = []
            for _ in range(reps):
                started = time.perf_counter()
                run()
                synchronize(self.device)
                times.append(1e3 * (time.perf_counter() - started))
            return min(times)

        widths = self._verify_widths()
        if isinstance(self.verifier, LocalVerifier):
            verify = [[w, fastest_ms(lambda w=w: self.verifier.warmup((w,), 1))] for w in widths]
        else:
            verify = [[w, float(w)] for w in widths]
        model = {}
        for name in models:
            runner = self.drafters[name].runner
            one = [[w, fastest_ms(lambda w=w: runner.warmup((w,), last_only=True, rows=1))] for w in (1, 2)]
            ids = torch.zeros(1, max(CATCH_UP), dtype=torch.long, device=runner.device)
            model[name] = one + [[w, fastest_ms(lambda w=w: runner.extend(ids[:, :w], torch.arange(w, device=runner.device)[None], 0))]
                                 for w in CATCH_UP if w <= self.config.max_len]  # fmt: skip
        return RowCosts(verify=verify, model=model, host={n: 0.02 for n in self.drafters if isinstance(self.drafters[n], HostDrafter)})

    def _verify_widths(self) -> tuple[int, ...]:
        """Target widths: K+1 per K bucket; a host drafter's short proposal rounds up to a bucket,
        so a fixed k with host drafters may verify any bucket up to it."""
        if not self.drafting:
            return (1,)
        widths = set(self.config.verify_widths)
        # Proposals of any length up to k_max: host drafters, a request's own K, a goodput cap.
        if self._distinct(HostDrafter) or self.config.request_k_max or self.config.step_k == "goodput":
            widths |= {1} | {k + 1 for k in self.config.k_buckets if k <= self.config.k_max}
        return tuple(sorted(widths))

    # ---- admission and retirement --------------------------------------------------------------

    def _check_fits(self, r: Request) -> None:
        if not r.prompt_ids:
            raise ValueError("empty prompt: give at least one token")
        if r.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={r.max_new_tokens} must be >= 1")
        if r.drafter is not None and r.drafter not in self.drafter_names:
            raise ValueError(f"unknown drafter {r.drafter!r}; this engine has {', '.join(self.drafter_names)}")
        if r.k is not None and not 0 <= r.k <= self.config.k_max:
            raise ValueError(f"k={r.k} (num_speculative_tokens) must be in 0..{self.config.k_max}, this engine's largest K")
        k_max = self.config.k_max if self.drafting else 0
        need = len(r.prompt_ids) + r.max_new_tokens + k_max + 1
        if need > self.config.max_len:
            raise ValueError(
                f"prompt of {len(r.prompt_ids)} tokens + max_new_tokens={r.max_new_tokens} (+{k_max + 1} for "
                f"speculation) exceeds the context max_len={self.config.max_len}: shorten the prompt, "
                "lower max_new_tokens, or raise max_len"
            )

    def _admit(self, b: int, index: int, request: Request) -> tuple[_Slot, bool] | None:
        """Prefill the request into slot b and draw its first token from the target; returns the
        slot and whether the request is already finished (EOS, one-token limit or stop string),
        or None if the target cannot take it now."""
        started = time.perf_counter()
        # Unseeded requests draw a fresh seed without reseeding torch's global generator.
        seed = request.params.seed if request.params.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(seed)
        ids = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)  # [1, L]
        drafter = self._drafter_of(request)
        k_max = self.config.k_max if self.drafting else 0
        try:
            first_id = self.verifier.prefill(b, ids, request.params, torch.rand(1, generator=generator),
                                             max_new_tokens=request.max_new_tokens, k_max=k_max)  # fmt: skip
        except VerifierError as e:
            e.request_ids.append(index)  # this request fails with the others
            raise
        if first_id is None:
            return None
        reused_s = self.verifier.reused_prefill_s
        if reused_s is not None:  # charged as if computed here, so its timings compare with any other request's
            started -= reused_s
        if drafter in self.drafters:
            private = request.params.seeded_sampling
            hidden = self.verifier.prompt_features if self.drafters[drafter].target_layers else None  # [L, n * H]
            self.drafters[drafter].start(b, RowContext(index, request.prompt_ids, request.prediction, private, hidden))
        done = start_row(self.state, b, ids[0], first_id, request.max_new_tokens)
        self._sampling = None
        stats = RequestStats(new_tokens=1, prefill_reused=reused_s is not None)
        stats.prefill_time_s = time.perf_counter() - started
        slot = _Slot(index, request, ids.shape[1], generator, [first_id], [TARGET_ORIGIN], stats, started, drafter,
                     k_value=self._k_start)  # fmt: skip
        if request.expected_acceptance is not None and self.config.step_k == "goodput":
            k = max(1, self._row_k(slot))
            slot.prior_a = float(per_token_acceptance(torch.tensor([float(request.expected_acceptance)]), k))
        stopped = self._hit_stop(slot, 0)
        if drafter in self.drafters:
            if self.drafters[drafter].target_layers:  # the prompt's features came with start: none are new
                self.drafters[drafter].observe(b, slot.generated, hidden=self.verifier.prompt_features[:0])
            else:
                self.drafters[drafter].observe(b, slot.generated)
        return slot, done or stopped

    def _drafter_of(self, request: Request) -> str:
        """The drafter a request drafts with: the one it names, else ``prediction`` when it carries
        one (OpenAI's Predicted Outputs), else the engine's default."""
        if request.drafter is not None:
            return request.drafter
        if request.prediction and PREDICTION in self.drafters:
            return PREDICTION
        return self.default_drafter

    def _stop_drafter(self, b: int, slot: _Slot, finished: bool) -> None:
        if slot.drafter in self.drafters:
            self.drafters[slot.drafter].stop(b, finished)

    def _retire(self, b: int, slots: list[_Slot | None]) -> Completion:
        slot = slots[b]
        slots[b] = None
        self.state.done[b] = True
        self._sampling = None
        self._stop_drafter(b, slot, finished=True)
        self.verifier.release(b)
        tokens = slot.generated
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        stop_at = min((i for i in (text.find(s) for s in slot.request.stop) if i >= 0), default=-1)
        if stop_at >= 0:
            text, reason = text[:stop_at], "stop"
        elif tokens and tokens[-1] in self._eos:
            reason = "stop"
        else:
            reason = "length"
        slot.stats.new_tokens = len(tokens)
        slot.stats.total_time_s = time.perf_counter() - slot.started
        params = slot.request.params
        stats = slot.stats.to_dict() | {"drafter": slot.routed_drafter or slot.drafter, "exact": not params.lossy,
                                        "verification": params.verification}  # fmt: skip
        if slot.fell_back_at is not None:
            stats["fallback"] = {"to": slot.drafter, "at_token": slot.fell_back_at}
        return Completion(tokens, text, reason, stats, origins=list(slot.origins))

    def _emit(self, b: int, finished: bool) -> StepOutput:
        slot = self._slots[b]
        new, origins = slot.generated[slot.emitted :], slot.origins[slot.emitted :]
        slot.emitted = len(slot.generated)
        return StepOutput(slot.index, new, self._retire(b, self._slots) if finished else None, origins)

    def _hit_stop(self, slot: _Slot, before: int) -> bool:
        """True if a stop string appears in the text; cuts ``generated`` just after the token that
        completed it (tokens the step committed past it are dropped). ``before``: tokens already
        checked, so only the step's new ones are searched."""
        stops = slot.request.stop
        if not stops:
            return False
        for end in range(max(before, 1), len(slot.generated) + 1):
            text = self.tokenizer.decode(slot.generated[:end], skip_special_tokens=True)
            if any(s in text for s in stops):
                del slot.generated[end:]
                del slot.origins[end:]
                return True
        return False

    def _fail(self, rows: list[int]) -> list[int]:
        """Drop the requests in ``rows`` without finishing them (the verifier failed them); returns their ids."""
        ids = []
        for b in rows:
            slot = self._slots[b]
            if slot is None:
                continue
            ids.append(slot.index)
            self._slots[b] = None
            self.state.done[b] = True
            self._stop_drafter(b, slot, finished=False)
            self.verifier.release(b)
        self._sampling = None
        return ids

    # ---- one step ------------------------------------------------------------------------------

    def _batch_sampling(self, slots: list[_Slot | None]) -> SamplingTensors:
        if self._sampling is None or self._sampling.temperature.shape[0] != len(slots):
            params = [s.request.params if s else SamplingParams() for s in slots]
            self._sampling = SamplingTensors.build(params, self.device)
        return self._sampling

    def _bucket(self) -> int:
        """The smallest batch bucket holding every occupied slot (requests take the lowest free one)."""
        last = max((b for b, s in enumerate(self._slots) if s is not None), default=0)
        return next(n for n in self.config.batch_buckets if n > last)

    def _state_rows(self, rows: int) -> DecodeState:
        """The decode state of the first ``rows`` slots: views, so every write lands in the whole
        (made per step, so they always view the state's current tensors)."""
        s = self.state
        if rows == s.lengths.shape[0]:
            return s
        return DecodeState(s.tokens[:rows], s.lengths[:rows], s.limits[:rows], s.done[:rows], s.eos_ids)

    def _row_k(self, slot: _Slot | None) -> int:
        """The request's draft budget this step: 0 for ``none``; a host drafter's own k if it has
        one; else the engine's k, or with "auto" the largest bucket the request's own K value
        reaches."""
        if slot is None or slot.drafter == NONE or not self.drafting:
            return 0
        if slot.request.k is not None:
            return min(slot.request.k, self.config.k_max)
        own = self.drafters[slot.drafter].k
        if own is not None:
            return min(own, self.config.k_max)
        if self.config.k != "auto":
            return int(self.config.k)
        fitting = [k for k in self.config.k_buckets if k <= slot.k_value]
        return fitting[-1] if fitting else self.config.k_buckets[0]

    def _draft(
        self, slots: list[_Slot | None], state: DecodeState, sampling: SamplingTensors, rand: StepRandom, k_rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """Step 1 for every drafter's rows: (draft_tokens [B, K] long, q [B, K, V], n_draft [B] long,
        the rows' budgets after step_k's cap), K the step's K bucket. Host drafters propose on the
        host (q: a point mass at each token); each batch drafter (a draft model) drafts on the
        device for its own rows (``ModelDrafter.propose_rows``), the other rows left alone."""
        B, V = len(slots), self.vocab_size
        host_tokens = [[] for _ in slots]
        if self.config.step_k == "goodput":  # before any proposal: a step that would not draft skips proposing
            k_rows, _ = self._cap(slots, k_rows, None)
        routes: dict[int, Drafter] = {}  # row -> the drafter that drafts it this step
        self._choices = {}
        for b, slot in enumerate(slots):
            drafter = self.drafters.get(slot.drafter) if slot is not None else None
            if k_rows[b] and isinstance(drafter, RoutingDrafter):  # auto: this step's drafter for the row
                choice = drafter.choose(b, slot.request.prompt_ids + slot.generated, k_rows[b], slot.request.drafter_priors)
                k_rows[b] = choice.k if choice.drafter is not None else 0
                self._choices[b] = choice.drafter or NONE
                if choice.tokens is not None:
                    host_tokens[b] = choice.tokens[: k_rows[b]]
                elif choice.drafter is not None:
                    routes[b] = self.drafters[choice.drafter]
            elif k_rows[b] and isinstance(drafter, HostDrafter):
                host_tokens[b] = drafter.propose(b, slot.request.prompt_ids + slot.generated, k_rows[b])[: k_rows[b]]
            if slot is not None and drafter is not None:
                routes.setdefault(b, drafter)
        if self.config.step_k == "goodput":
            k_rows, host_tokens = self._cap(slots, k_rows, host_tokens)
        proposals = []
        started, forwards = time.perf_counter(), 0
        for drafter in self._distinct(BatchDrafter):
            mine = [k_rows[b] if routes.get(b) is drafter else 0 for b in range(len(slots))]
            proposal = drafter.propose_rows(DraftBatch(mine, state, sampling, rand, V, self.config.batch_buckets,
                                                       self.config.draft_confidence, self.config.draft_stop,
                                                       self.config.k_max))  # fmt: skip
            if proposal is not None:
                proposals.append((proposal, torch.tensor([m > 0 for m in mine], device=self.device)))  # [B] its rows
                forwards += proposal.forwards
        if forwards:
            synchronize(self.device)
        self._model_draft = (time.perf_counter() - started, forwards)
        draft_tokens, q, n_draft = self._merge(host_tokens, proposals)
        return draft_tokens, q, n_draft, k_rows

    def _merge(self, host_tokens: list[list[int]], proposals: list[tuple[Proposal, torch.Tensor]]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The host rows' tokens and each batch drafter's proposal for its rows (``mine`` [B]) as one
        block at the step's K: the smallest bucket that holds every proposal (a compiled verify width)."""
        B, V = len(host_tokens), self.vocab_size
        width = max([*map(len, host_tokens), *(p.tokens.shape[1] for p, _ in proposals)])
        k = next((kb for kb in self.config.k_buckets if kb >= width), width) if width else 0
        rows = torch.tensor([t + [0] * (k - len(t)) for t in host_tokens], dtype=torch.long).reshape(B, k)
        draft_tokens = rows.to(self.device)  # [B, K]
        n_draft = torch.tensor([len(t) for t in host_tokens], dtype=torch.long, device=self.device)  # [B]
        q = torch.nn.functional.one_hot(draft_tokens, V).float() if any(host_tokens) else None  # [B, K, V] point masses
        for p, mine in proposals:
            pad = k - p.tokens.shape[1]
            tokens = torch.nn.functional.pad(p.tokens, (0, pad))  # [B, K]
            q_m = torch.nn.functional.pad(p.q, (0, 0, 0, pad))  # [B, K, V]
            draft_tokens = torch.where(mine.unsqueeze(1), tokens, draft_tokens)
            n_draft = torch.where(mine, p.n, n_draft)
            if q is None and len(proposals) == 1:
                q = q_m  # the only proposer: rows not its own have n_draft 0, so their q is masked
            else:
                q = torch.where(mine.view(B, 1, 1), q_m, q if q is not None else torch.zeros_like(q_m))
        if q is None:
            q = torch.zeros(B, k, V, device=self.device)  # [B, K, V] nothing drafted
        return draft_tokens, q, n_draft

    def _cap(self, slots: list[_Slot | None], k_rows: list[int], host_tokens: list[list[int]] | None
             ) -> tuple[list[int], list[list[int]] | None]:  # fmt: skip
        """step_k goodput: the budgets and host proposals capped at the K that maximises the batch's
        expected tokens per ms (``goodput.plan_cap``). A host row's budget is what it proposed (known
        once proposed: ``host_tokens``) or, before proposing (None), its K: an upper bound, so a cap
        of 0 then stays 0 and the proposals need not be made. Seeded sampled rows keep theirs."""
        keep = [slot is not None and slot.request.params.seeded_sampling for slot in slots]
        expected, fixed, model_budget = [], [], 0
        for b, slot in enumerate(slots):
            if slot is None:
                continue
            drafter = self.drafters.get(slot.drafter)
            budget = len(host_tokens[b]) if host_tokens is not None and isinstance(drafter, HostDrafter) else k_rows[b]
            if isinstance(drafter, BatchDrafter):
                model_budget = max(model_budget, budget)
            st = slot.stats
            expected.append(expected_from_counts(st.accepted_at, st.drafted_at, budget, slot.prior_a))
            fixed.append(keep[b])
        B = len(slots)
        cap = plan_cap(expected, fixed, lambda c: self.step_costs.step_ms(B, c, model_budget), self.config.k_buckets)
        if cap is None:
            return k_rows, host_tokens
        return ([k if keep[b] else min(k, cap) for b, k in enumerate(k_rows)],
                None if host_tokens is None else [t if keep[b] else t[:cap] for b, t in enumerate(host_tokens)])  # fmt: skip

    def _step(self, all_slots: list[_Slot | None]) -> tuple[list[int], VerifierError | None]:
        """One speculative step over the occupied slots, at the smallest batch bucket that holds
        them; returns the slots whose request finished, and the verifier's error for rows it could
        not verify (they committed nothing; their requests fail)."""
        B = self._bucket()
        slots, s = all_slots[:B], self._state_rows(B)
        k_rows = [self._row_k(slot) for slot in slots]
        k = max(k_rows)  # the largest budget; the step's K is the longest proposal's bucket
        n_before = s.lengths.clone()
        times: dict[str, float] = {}
        last = [time.perf_counter()]

        def clock(phase: str) -> None:
            synchronize(self.device)
            now = time.perf_counter()
            times[phase] = now - last[0]
            last[0] = now

        sampling = self._batch_sampling(slots)
        # Padded to the widest K a step can verify (a short proposal rounds up to a K bucket); what
        # each row draws still depends on its own budget only.
        width = max(k, self.config.k_max if self.drafting else 0)
        rand = step_uniforms([slot.generator if slot else None for slot in slots], k_rows, width, self.device)
        # 1. Draft: every drafter proposes for its own rows, padded to the step's K bucket.
        draft_tokens, q, n_draft, k_rows = self._draft(slots, s, sampling, rand, k_rows)
        clock("draft")
        # 2-3. Verify once and accept/reject: the target's accepted count and next token per row.
        params = [slot.request.params if slot else None for slot in slots]
        verdict = self.verifier.verify(VerifyBatch(s, params, sampling, rand, draft_tokens, q, n_draft))
        clock("target")
        self.step_costs.observe(B, draft_tokens.shape[1] + 1, 1e3 * times["target"])
        if self._model_draft[1]:
            self.step_costs.observe_draft(B, self._model_draft[1], 1e3 * self._model_draft[0])
        # 4. Commit the accepted tokens and the next one (a row the verifier failed commits nothing).
        lost = verdict.failed.rows if verdict.failed is not None else []
        for b in lost:
            s.done[b] = True
        n_acc, n_new = verdict.n_accepted, commit(s, draft_tokens, verdict.n_accepted, verdict.next_token)
        k = draft_tokens.shape[1]
        committed = s.tokens.gather(1, n_before.unsqueeze(1) + torch.arange(k + 1, device=self.device))
        # 5. The single host sync of the step.
        rows = torch.cat([n_acc[:, None], n_new[:, None], s.done[:, None].long(), n_draft[:, None], committed], 1)
        rows = rows.tolist()

        finished, after_commit = [], {}
        lo, hi = self.config.k_buckets[0], self.config.k_buckets[-1]
        for b, slot in enumerate(slots):
            if slot is None or b in lost:
                continue
            accepted, new, done, drafted, tokens = rows[b][0], rows[b][1], bool(rows[b][2]), rows[b][3], rows[b][4:]
            before = len(slot.generated)
            slot.generated += tokens[:new]
            proposer = self._choices.get(b, slot.drafter) if drafted else NONE
            slot.origins += step_origins(proposer, drafted, accepted, new)
            slot.stats.record_step(drafted, accepted, new, times.get("draft", 0.0), times.get("target", 0.0),
                                   drafter=proposer)  # fmt: skip
            if b in self._choices:  # auto: the verdict on its choice
                self.drafters[slot.drafter].settle(b, drafted, accepted)
            if self.config.k == "auto" and k_rows[b]:  # Hugging Face's heuristic, per request: +2 after a full accept, else -1
                slot.k_value = min(hi, slot.k_value + 2) if accepted == drafted else max(lo, slot.k_value - 1)
            try:
                # Stop strings first: a step that also reaches the length limit must still cut at the stop.
                stopped = self._hit_stop(slot, before)
                if slot.drafter in self.drafters and len(slot.generated) > before:  # what the row kept
                    self._observe(b, slot, before, verdict.features)
            except Exception as e:  # committed already: this row fails, the step stands for the others
                after_commit[b] = e
                continue
            if done or stopped:
                finished.append(b)
            elif slot.request.fallback is not None and k_rows[b]:
                self._maybe_fall_back(b, slot)
        if after_commit:
            raise _Committed(after_commit, finished, verdict.failed)
        return finished, verdict.failed

    def _observe(self, b: int, slot: _Slot, before: int, features: torch.Tensor | None) -> None:
        """Tell the row's drafter what the step committed; one that reads the target's features gets
        those of the positions now known: x_{n-1} and the accepted drafts, one per new token (the
        feature of position p comes with token p + 1; the prompt's all came with ``start``)."""
        drafter, new = self.drafters[slot.drafter], slot.generated[before:]
        if drafter.target_layers:
            drafter.observe(b, new, hidden=features[b, : len(new)])  # [len(new), n * H]
        else:
            drafter.observe(b, new)

    def _maybe_fall_back(self, b: int, slot: _Slot) -> None:
        """Switch the row to the target alone once its acceptance so far shows it below the request's
        floor (``Fallback.fires``); the next step verifies one token for it."""
        s = slot.stats
        if slot.request.fallback.fires(s.accepted, s.drafted):
            self._stop_drafter(b, slot, finished=False)
            slot.routed_drafter, slot.drafter = slot.drafter, NONE
            slot.fell_back_at = len(slot.generated)


class _Committed(Exception):
    """Rows of a step failed after the step committed (their stop check or drafter update):
    ``rows`` slot -> error; ``finished`` and ``failed`` are the step's results for the others."""

    def __init__(self, rows: dict[int, BaseException], finished: list[int], failed: VerifierError | None) -> None:
        super().__init__("; ".join(f"slot {b}: {type(e).__name__}: {e}" for b, e in sorted(rows.items())))
        self.rows, self.finished, self.failed = rows, finished, failed
