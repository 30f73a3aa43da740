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

1. draft (``serving.engine.drafting``): every drafter proposes for its own rows (a draft model on
   the device over its own rows, at the smallest batch bucket holding them; a host drafter on the
   host), at each row's budget (``serving.engine.k_policy``), padded to the step's K bucket;
2. verify: the verifier runs one target forward over every row (a ``none`` row verifies a single
   token) and
3. accepts or rejects each row's proposal (``serving.engine.acceptance``), drawing the correction
   or bonus token;
4. commit the answer into the decode state (``commit``), then read back one small tensor: the
   step's single host sync.

The host then applies stop strings, tells each drafter what its rows committed (``observe``: the
moment a drafter's provisional state becomes the row's), retires finished requests and admits
waiting ones into free slots (``serving.engine.slots``), so ``generate`` already batches
continuously. The engine never asks which kind a drafter is, only what it declares
(``serving.engine.drafters.base``). A step runs at the smallest batch bucket that
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
import secrets
import time
from collections.abc import Mapping

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from serving.engine import warmup as _warmup
from serving.engine.devices import synchronize
from serving.engine.drafters.base import NONE, PREDICTION, Drafter, RowContext
from serving.engine.drafters.model import as_drafter
from serving.engine.drafters.prediction import PredictionDrafter
from serving.engine.drafting import GRAMMAR, distinct, draft
from serving.engine.engine_settings import EngineConfig
from serving.engine.fallback import fall_back
from serving.engine.goodput import StepCosts
from serving.engine.k_policy import KPolicy
from serving.engine.processors import Processors
from serving.engine.request import (
    TARGET_ORIGIN, Completion, Request, RequestFailed, StepOutput, describe_errors, step_origins,
)
from serving.engine.sampling import SamplingParams, SamplingTensors
from serving.engine.slots import Slot, SlotTable, check_fits, completion, drafter_of, hit_stop, host_logprobs
from serving.engine.speculative import DecodeState, commit, start_row, step_uniforms
from serving.engine.stats import RequestStats
from serving.engine.verifier import LocalVerifier, Verifier, VerifierError, VerifyBatch

log = logging.getLogger(__name__)

Drafters = Mapping[str, "PreTrainedModel | Drafter | None"]


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
        ``drafters``: name -> a draft model (on the target's tokenizer), a ``Drafter``, or None
        (another name for the target alone). ``draft`` is shorthand for ``{"draft": draft}``.
        ``none`` always exists, ``prediction`` wherever there is another drafter.
        ``default_drafter``: for requests that name none (default: the first of ``drafters``, else
        ``none``)."""
        config = config or EngineConfig()
        if draft is not None and drafters is not None:
            raise ValueError("give either draft (one draft model) or drafters (name -> drafter), not both")
        drafters = drafters if drafters is not None else ({"draft": draft} if draft is not None else {})
        self.verifier = target if isinstance(target, Verifier) else LocalVerifier(target, tokenizer)
        self.verifier.bind(config)  # fills in config.max_len
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = self.verifier.vocab_size
        self.drafters = self._bind_drafters(drafters)
        # The decode state lives where the target reads it, else with the drafts (a remote target).
        devices = [d.device for d in distinct(self.drafters) if d.device is not None]
        self.device = self.verifier.device or (devices[0] if devices else torch.device("cpu"))
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
        self.k_policy = KPolicy(config, self.drafters)
        self.processors = Processors(B, self.vocab_size, self.device, tokenizer)  # bias, penalties, grammars per row
        self._slots = SlotTable(B)
        self._carry: list[StepOutput] = []  # outputs of a step that raised, handed out by the next one
        # Measured step times by (rows, width): what step_k goodput prices a step with; a profiled
        # table (``StepCosts.table``, the router's step_table when serving) stands in until measured.
        self.step_costs = StepCosts()
        if config.compile_backend is not None:
            self.enable_compile(config.compile_backend)
        if config.cuda_graphs:
            self.enable_cuda_graphs()
        if config.step_k == "goodput" and self.drafting and config.max_batch_size > 1:  # a lone row is never capped
            self.time_steps()
        for routing in [d for d in distinct(self.drafters) if d.routes]:
            routing.price(self.row_costs(routing.model_costs_needed), self.verify_widths())

    def _bind_drafters(self, given: Drafters) -> dict[str, Drafter]:
        """The engine's drafters by name, bound to its shapes: a draft model becomes a
        ``ModelDrafter`` (two names of one model share it); None (the target alone) is left out, as
        is every drafter of an engine with k=0. An engine that drafts also takes ``prediction``."""
        if self.config.k == 0:
            return {}
        wrapped: dict[int, Drafter] = {}
        out: dict[str, Drafter] = {}
        for name, d in given.items():
            if d is not None:
                out[name] = wrapped.setdefault(id(d), as_drafter(d))
        if out:
            out.setdefault(PREDICTION, PredictionDrafter())
        layers = {tuple(d.target_layers) for d in out.values() if d.target_layers}
        if len(layers) > 1:
            raise ValueError(f"drafters read the target's features of different layers {sorted(layers)}: one engine "
                             "captures one set; give its drafters the same eagle_aux_hidden_state_layer_ids")  # fmt: skip
        self.feature_layers = layers.pop() if layers else ()
        if self.feature_layers:  # EAGLE-3 heads: the verifier hands out the target's features
            self.verifier.capture(self.feature_layers)
        for d in distinct(out):
            if d.routes:  # auto: drafts with the others
                d.attach(out)
            d.bind(batch_size=self.config.max_batch_size, max_len=self.config.max_len, vocab_size=self.vocab_size)
        return out

    @property
    def drafting(self) -> bool:
        """Whether any request can draft (else every step verifies one token per row)."""
        return bool(self.drafters)

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
        return self._slots.queue(request)

    def abort_request(self, request_id: int) -> bool:
        """Drop a waiting or running request (e.g. its client went away) and free its slot.
        Returns whether it was found."""
        if self._slots.unqueue(request_id):
            return True
        b = self._slots.find(request_id)
        if b is not None:
            self._fail([b])
        return b is not None

    def has_unfinished_requests(self) -> bool:
        # Outputs carried over from a step that raised (possibly a finished one) still need a step
        # to be handed out, even when no slot is running any more.
        return bool(self._carry) or bool(self._slots.waiting) or bool(self._slots.running)

    @property
    def num_running(self) -> int:
        return len(self._slots.running)

    @property
    def num_waiting(self) -> int:
        return len(self._slots.waiting)

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
            e.request_ids += self._fail(self._slots.running if e.rows is None else e.rows)
            self._carry = [o for o in outputs if o.request_id not in e.request_ids]
            raise
        except RequestFailed as e:
            self._carry = [o for o in outputs if o.request_id not in e.request_ids]
            raise
        return outputs

    def close(self) -> None:
        """Abort every request and close the verifier (a remote one's connection)."""
        self._fail(self._slots.running)
        self._slots.waiting.clear()
        self.verifier.close()

    # Warm-up and timing (serving.engine.warmup): functions of the engine, so they read as its methods.
    enable_compile = _warmup.enable_compile
    enable_cuda_graphs = _warmup.enable_cuda_graphs
    warmup = _warmup.warmup
    time_steps = _warmup.time_steps
    row_costs = _warmup.row_costs
    verify_widths = _warmup.verify_widths

    # ---- admission, isolation and retirement ---------------------------------------------------

    def _advance(self, outputs: list[StepOutput]) -> None:
        """The body of ``step``, appending to ``outputs`` as it goes so that what was produced
        before a ``VerifierError`` is still handed out."""
        slots = self._slots
        broken: dict[int, BaseException] = {}  # request id -> what failed it alone
        for b in range(len(slots)):
            while slots[b] is None and slots.waiting:
                request_id, request = slots.waiting.popleft()
                try:
                    admitted = self._admit(b, request_id, request)
                except VerifierError:
                    raise
                except Exception as e:  # this request alone: its prefill, drafter or stop check
                    self._unadmit(b)
                    broken[request_id] = e
                    continue
                if admitted is None:  # the target has no room now: retry on a later step
                    slots.waiting.appendleft((request_id, request))
                    break
                slots[b], finished = admitted
                outputs.append(self._emit(b, finished))
        if slots.running:
            finished, failed = self._step_or_isolate(broken)
            lost = failed.rows if failed is not None else ()
            for b in slots.running:
                if b not in lost:
                    outputs.append(self._emit(b, b in finished))
            if failed is not None:  # the target lost these rows: step() fails their requests
                if broken:
                    log.error("requests %s failed alone: %s", sorted(broken), describe_errors(broken))
                raise failed
        if broken:
            raise RequestFailed(broken)

    def _step_or_isolate(self, broken: dict[int, BaseException]) -> tuple[list[int], VerifierError | None]:
        """``_step`` over every running slot. If it raises (anything but the verifier's error),
        nothing was committed: each row then runs the step alone, from the random state it had
        before (its drafter's state is still the committed one: what a drafter changes while
        proposing waits for ``observe``), and only the rows that raise again fail (into
        ``broken``); the others advance exactly as they would have in the batch (the kernels are
        batch-invariant, and every row draws from its own generator)."""
        slots = self._slots
        before = {b: slots[b].generator.get_state() for b in slots.running}
        try:
            return self._step(list(slots))
        except VerifierError:
            raise
        except _Committed as e:  # rows failed after the commit: the others' step stands
            broken.update({slots[b].index: error for b, error in e.rows.items()})
            self._fail(list(e.rows))
            return e.finished, e.failed
        except Exception as e:
            if len(before) == 1:
                broken[slots[next(iter(before))].index] = e
                self._fail(list(before))
                return [], None
            log.warning("a step over rows %s raised %s: %s; running each row alone", sorted(before), type(e).__name__, e)
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
                except VerifierError:
                    raise
                except Exception as lone:
                    failed_rows.append(b)
                    broken[slots[b].index] = lone.rows[b] if isinstance(lone, _Committed) else lone
                done[b] = self.state.done[b]
        finally:
            self.state.done.copy_(done)
        self._sampling = None
        self._fail(failed_rows)
        return [b for b in finished if b not in failed_rows], failed

    def _check_fits(self, r: Request) -> None:
        check_fits(r, self.config, self.drafter_names, self.config.k_max if self.drafting else 0)

    def _admit(self, b: int, index: int, request: Request) -> tuple[Slot, bool] | None:
        """Prefill the request into slot b and draw its first token from the target; returns the
        slot and whether the request is already finished (EOS, one-token limit or stop string),
        or None if the target cannot take it now."""
        started = time.perf_counter()
        # Unseeded requests draw a fresh seed without reseeding torch's global generator.
        seed = request.params.seed if request.params.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(seed)
        ids = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)  # [1, L]
        name = drafter_of(request, self.drafters, self.default_drafter)
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
        drafter = self.drafters.get(name)
        features = self.verifier.prompt_features if drafter is not None and drafter.target_layers else None  # [L, n * H]
        if drafter is not None:
            private = request.params.seeded_sampling
            drafter.start(b, RowContext(index, request.prompt_ids, request.prediction, private, features))
        done = start_row(self.state, b, ids[0], first_id, request.max_new_tokens)
        self.processors.start(b, request.params, request.prompt_ids, first_id)
        self._sampling = None
        stats = RequestStats(new_tokens=1, prefill_reused=reused_s is not None)
        stats.prefill_time_s = time.perf_counter() - started
        slot = Slot(index, request, ids.shape[1], generator, [first_id], [TARGET_ORIGIN], stats, started, name,
                    k_value=self.k_policy.k_start)  # fmt: skip
        self.k_policy.prior(slot)
        if request.params.logprobs is not None:
            slot.logprobs = host_logprobs(self.verifier.first_logprobs, 0, [first_id], request.params.logprobs)
        stopped = hit_stop(slot, 0, self.tokenizer)
        if drafter is not None:  # the prompt's features came with start: none are new
            drafter.observe(b, slot.generated, hidden=None if features is None else features[:0])
        return slot, done or stopped

    def _stop_drafter(self, b: int, slot: Slot, finished: bool) -> None:
        if slot.drafter in self.drafters:
            self.drafters[slot.drafter].stop(b, finished)

    def _unadmit(self, b: int) -> None:
        """Undo what a failed admission into slot ``b`` may have set up (no slot was made)."""
        self.state.done[b] = True
        for drafter in distinct(self.drafters):
            try:
                drafter.stop(b, finished=False)
            except Exception:  # a drafter that never started this row
                pass
        self.verifier.forget(b)
        self.verifier.release(b)
        self._sampling = None

    def _emit(self, b: int, finished: bool) -> StepOutput:
        slot = self._slots[b]
        new, origins = slot.generated[slot.emitted :], slot.origins[slot.emitted :]
        logprobs = None if slot.logprobs is None else slot.logprobs[slot.emitted :]
        slot.emitted = len(slot.generated)
        return StepOutput(slot.index, new, self._retire(b) if finished else None, origins, logprobs)

    def _retire(self, b: int) -> Completion:
        slot = self._slots[b]
        self._slots[b] = None
        self.state.done[b] = True
        self._sampling = None
        self._stop_drafter(b, slot, finished=True)
        self.processors.stop(b)
        self.verifier.release(b)
        return completion(slot, self.tokenizer, self._eos, time.perf_counter())

    def _fail(self, rows: list[int]) -> list[int]:
        """Drop the requests in ``rows`` without finishing them (aborted, or failed); returns their ids."""
        ids = []
        for b in rows:
            slot = self._slots[b]
            if slot is None:
                continue
            ids.append(slot.index)
            self._slots[b] = None
            self.state.done[b] = True
            self._stop_drafter(b, slot, finished=False)
            self.processors.stop(b)
            self.verifier.release(b)
        self._sampling = None
        return ids

    # ---- one step ------------------------------------------------------------------------------

    def _batch_sampling(self, slots: list[Slot | None]) -> SamplingTensors:
        if self._sampling is None or self._sampling.temperature.shape[0] != len(slots):
            params = [s.request.params if s else SamplingParams() for s in slots]
            processors = self.processors.rows(len(slots), [s.request.params if s else None for s in slots])
            self._sampling = SamplingTensors.build(params, self.device, processors)
        return self._sampling

    def _step(self, all_slots: list[Slot | None]) -> tuple[list[int], VerifierError | None]:
        """One speculative step over the occupied slots, at the smallest batch bucket that holds
        them; returns the slots whose request finished, and the verifier's error for rows it could
        not verify (they committed nothing; their requests fail)."""
        B = self._slots.bucket(self.config.batch_buckets)
        slots, s = all_slots[:B], self.state.head(B)
        k_rows = [self.k_policy.row_k(slot) for slot in slots]
        n_before = s.lengths.clone()
        sampling = self._batch_sampling(slots)
        # Padded to the widest K a step can verify (a short proposal rounds up to a K bucket); what
        # each row draws still depends on its own budget only.
        width = max(max(k_rows), self.config.k_max if self.drafting else 0)
        rand = step_uniforms([slot.generator if slot else None for slot in slots], k_rows, width, self.device)
        started = time.perf_counter()
        # 1. Draft: every drafter proposes for its own rows, padded to the step's K bucket.
        d = draft(self.drafters, slots, s, sampling, rand, k_rows, self.k_policy, self.step_costs, self.config,
                  self.vocab_size, self.device, self.processors.forced(B))  # fmt: skip
        synchronize(self.device)
        drafted_at = time.perf_counter()
        # 2-3. Verify once and accept/reject: the target's accepted count and next token per row.
        params = [slot.request.params if slot else None for slot in slots]
        verdict = self.verifier.verify(VerifyBatch(s, params, sampling, rand, d.tokens, d.q, d.n))
        synchronize(self.device)
        times = {"draft": drafted_at - started, "target": time.perf_counter() - drafted_at}
        self.step_costs.observe(B, d.tokens.shape[1] + 1, 1e3 * times["target"])
        if d.forwards:
            self.step_costs.observe_draft(B, d.forwards, 1e3 * d.model_s)
        # 4. Commit the accepted tokens and the next one (a row the verifier failed commits nothing).
        lost = verdict.failed.rows if verdict.failed is not None else []
        for b in lost:
            s.done[b] = True
        n_acc, n_new = verdict.n_accepted, commit(s, d.tokens, verdict.n_accepted, verdict.next_token)
        k = d.tokens.shape[1]
        committed = s.tokens.gather(1, n_before.unsqueeze(1) + torch.arange(k + 1, device=self.device))  # [B, K+1]
        self.processors.commit(committed, n_new)
        # 5. The single host sync of the step (logprobs, when a row asks, come with it).
        rows = torch.cat([n_acc[:, None], n_new[:, None], s.done[:, None].long(), d.n[:, None], d.forced[:, None].long(),
                          committed], 1).tolist()  # fmt: skip
        logprobs = verdict.logprobs
        finished, after_commit = [], {}
        for b, slot in enumerate(slots):
            if slot is None or b in lost:
                continue
            accepted, new, done, drafted, grammar, tokens = (*rows[b][:2], bool(rows[b][2]), *rows[b][3:5], rows[b][5:])
            before = len(slot.generated)
            slot.generated += tokens[:new]
            if slot.logprobs is not None:
                slot.logprobs += host_logprobs(logprobs, b, tokens[:new], slot.request.params.logprobs)
            proposer = (GRAMMAR if grammar else d.proposers.get(b, slot.drafter)) if drafted else NONE
            slot.origins += step_origins(proposer, drafted, accepted, new)
            slot.stats.record_step(drafted, accepted, new, times["draft"], times["target"], drafter=proposer)
            slot.stats.capped_steps += b in d.capped
            if b in d.routed and not grammar:  # a routing drafter: the verdict on its choice
                self.drafters[slot.drafter].settle(b, drafted, accepted)
            self.k_policy.after_step(slot, d.budgets[b], drafted, accepted)
            try:
                # Stop strings first: a step that also reaches the length limit must still cut at the stop.
                stopped = hit_stop(slot, before, self.tokenizer)
                self.processors.observe(b, slot.generated[before:])
                if slot.drafter in self.drafters and len(slot.generated) > before:  # what the row kept
                    self._observe(b, slot, before, verdict.features)
            except Exception as e:  # committed already: this row fails, the step stands for the others
                after_commit[b] = e
                continue
            if done or stopped:
                finished.append(b)
            elif d.budgets[b]:
                fall_back(slot, lambda: self._stop_drafter(b, slot, finished=False))
        if after_commit:
            raise _Committed(after_commit, finished, verdict.failed)
        return finished, verdict.failed

    def _observe(self, b: int, slot: Slot, before: int, features: torch.Tensor | None) -> None:
        """Tell the row's drafter what the step committed (its proposal's state becomes the row's);
        one that reads the target's features gets those of the positions now known: x_{n-1} and
        the accepted drafts, one per new token (the feature of position p comes with token p + 1)."""
        drafter, new = self.drafters[slot.drafter], slot.generated[before:]
        drafter.observe(b, new, hidden=features[b, : len(new)] if drafter.target_layers else None)  # [len(new), n * H]


class _Committed(Exception):
    """Rows of a step failed after the step committed (their stop check or drafter update):
    ``rows`` slot -> error; ``finished`` and ``failed`` are the step's results for the others."""

    def __init__(self, rows: dict[int, BaseException], finished: list[int], failed: VerifierError | None) -> None:
        super().__init__("; ".join(f"slot {b}: {type(e).__name__}: {e}" for b, e in sorted(rows.items())))
        self.rows, self.finished, self.failed = rows, finished, failed
