"""Mutation check for the exactness tests: apply known-bad changes one at a time, run the tests
that should catch each, and report any that survive.

    python scripts/mutation_check.py            # every mutant; exit 1 if one survives or is stale
    python scripts/mutation_check.py --list     # the mutants and their tests
    python scripts/mutation_check.py stop-kept  # some of them, by name

Each mutant is one exact text replacement in one file. The tree is copied (tracked files and
untracked, unignored ones) into a temporary folder and the mutant applied there, so the working
tree is never touched. A mutant whose text no longer occurs exactly once is reported as stale: a
refactor moved the code, and the mutant must follow it (a silent skip would hide a lost check).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from serving.engine.devices import cpu_flags

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str  # what the change breaks
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, -k expressions
    # CPU flags (as /proc/cpuinfo names them) without which the mutated code is not compiled or not
    # run here: on a CPU that lacks one the tests pass whatever the mutant did, which is no survival.
    needs: tuple[str, ...] = ()


STOP_TESTS = ("tests/test_engine_tiny.py", "-k", "stop")
DISTRIBUTION = ("tests/test_distribution.py", "-k", "follows or early_stops")
ACCEPTANCE = ("tests/test_acceptance.py", "tests/test_distribution.py", "-k", "not catches")
AUTO_TESTS = ("tests/test_auto_drafter.py", "-m", "integration")
EAGLE3_TESTS = ("tests/test_eagle3.py", "-m", "integration or e2e", "-k", "not sampled")
THRESHOLD_TESTS = ("tests/test_engine_tiny.py", "-k", "threshold")
KIT = "tests/test_drafter_conformance.py"  # the drafter conformance kit (issue 70)
KIT_FAST = (KIT, "-m", "not slow")
ROW_TESTS = ("tests/test_engine_drafters.py", "-k", "every_slot_position or every_row_and_slot or accept_in_a_batch or free_its_rows")

MUTANTS = [
    Mutant("stop-kept", "tokens generated after a stop string are kept instead of cut",
           "serving/engine/slots.py", "            del slot.generated[end:]\n", "            pass\n", STOP_TESTS),
    Mutant("stop-after-limit", "the length limit is checked before the stop strings (a step that reaches "
           "both keeps the tokens past the stop)", "serving/engine/core.py",
           "                stopped = hit_stop(slot, before, self.tokenizer)\n",
           "                stopped = not done and hit_stop(slot, before, self.tokenizer)\n", STOP_TESTS),
    Mutant("accept-reuses-draft-uniforms", "accept tests reuse the uniforms that drew the draft tokens",
           "serving/engine/speculative.py", "draft[b, :kb], accept[b, :kb], nxt[b] = u[:kb], u[kb : 2 * kb], u[2 * kb]",
           "draft[b, :kb], accept[b, :kb], nxt[b] = u[:kb], u[:kb], u[2 * kb]", DISTRIBUTION),
    Mutant("draft-stop-looks-at-token", "drafting stops before a drawn token the draft found unlikely "
           "(a token-dependent stop)", "serving/engine/speculative.py",
           "            n_draft = n_draft + drafting.long()\n            drafting = drafting & (budget > i + 1)\n",
           "            likely = q_i.gather(-1, drafted[-1].unsqueeze(-1)).squeeze(-1) >= (draft_confidence or 0.0)\n"
           "            drafting = drafting & likely\n"
           "            n_draft = n_draft + drafting.long()\n            drafting = drafting & (budget > i + 1)\n",
           ("tests/test_distribution.py", "-k", "early_stops")),
    Mutant("k-per-batch", "every row drafts the batch's K (seeded output then depends on the batch)",
           "serving/engine/core.py", "        k_rows = [self.k_policy.row_k(slot) for slot in slots]\n",
           "        k_rows = [max(self.k_policy.row_k(slot) for slot in slots)] * len(slots)\n",
           ("tests/test_engine_tiny.py", "-k", "k_auto")),
    Mutant("frozen-row-past-cache", "a frozen row runs at positions past its cache (mixed K on a shared target)",
           "serving/engine/speculative.py",
           "    verify_pos = torch.where(state.done.unsqueeze(1), verify_pos.clamp(max=target.max_len - 1), verify_pos)\n",
           "", ("tests/test_distributed.py", "-k", "context_end")),
    Mutant("padding-accepted", "padding slots after a row's last draft token can be accepted",
           "serving/engine/acceptance.py", "    if n_draft is not None:\n        accepted &= real\n", "",
           ("tests/test_distribution.py", "-k", "mixed")),
    Mutant("residual-is-p", "on rejection the token is drawn from p instead of the residual max(0, p - q)",
           "serving/engine/acceptance.py", "    residual = (p_at - q_pad.gather(1, at).squeeze(1)).clamp(min=0.0)  # [B, V]",
           "    residual = p_at  # [B, V]", ACCEPTANCE),
    Mutant("q-off-by-one", "the residual subtracts the draft distribution of the next position",
           "serving/engine/acceptance.py", "q_pad.gather(1, at).squeeze(1)).clamp(min=0.0)",
           "q_pad.gather(1, (at + 1).clamp(max=K)).squeeze(1)).clamp(min=0.0)", ACCEPTANCE),
    Mutant("bonus-misplaced", "the bonus token is drawn from the last draft position's p",
           "serving/engine/acceptance.py", "    p_at = p.gather(1, at).squeeze(1)  # [B, V]",
           "    p_at = p.gather(1, at.clamp(max=max(K - 1, 0))).squeeze(1)  # [B, V]", ACCEPTANCE),
    # Dropping top-p from q everywhere would still be lossless (any q is, if the tokens are drawn
    # from it); the bug is a q that is not the distribution the draft tokens were drawn from.
    Mutant("top-p-missing-on-draws", "draft tokens are drawn without top-p while q, used to accept them, has it",
           "serving/engine/speculative.py", "            drafted.append(sample(q_i, rand.draft[:, i]))  # [B]",
           "            drafted.append(sample(probs_from_logits(logits, type(sampling)(sampling.temperature, "
           "sampling.top_k, torch.ones_like(sampling.top_p), sampling.filters, sampling.all_greedy))[:, 0], "
           "rand.draft[:, i]))  # [B]", DISTRIBUTION),
    Mutant("top-p-missing-on-p", "the target's p ignores top-p", "serving/engine/speculative.py",
           "    p = probs_from_logits(logits, sampling)  # [B, K+1, V]",
           "    p = probs_from_logits(logits, type(sampling)(sampling.temperature, "
           "sampling.top_k, torch.ones_like(sampling.top_p), sampling.filters, sampling.all_greedy))  # [B, K+1, V]",
           DISTRIBUTION),
    # The CPU kernels' batch invariance on the paths the bundled models do not take, and the
    # prepared-weights cache's key.
    Mutant("torch-silu-on-hf-path", "the Hugging Face MLP keeps torch's SiLU (an element's last bit depends on "
           "how many rows run together)", "serving/engine/cpu_kernels.py",
           "    if kernel == \"rowdot\":\n        _use_row_silu(model, max_rows)\n", "",
           ("tests/test_cpu_kernels.py", "-k", "hugging_face_mlp")),
    Mutant("fallback-attention-batch-extent", "without the C++ kernel, a row attends over the batch's longest extent",
           "serving/engine/cpu_kernels.py", "    lengths = (allowed * pos).amax(dim=-1)  # [B, q] keys up to the last allowed one\n",
           "    lengths = (allowed * pos).amax(dim=-1).amax(dim=0, keepdim=True).expand(allowed.shape[0], -1)\n",
           ("tests/test_cpu_kernels.py", "-k", "fallback_gives")),
    Mutant("amx-scales-grouped", "the AMX int8 path multiplies the two scales first (its rows then differ "
           "from the one-row VNNI step in the last bit)", "serving/engine/rowdot.cpp",
           "float(dots[o][r] - W8A8_SHIFT * wsum[n + o]) * xs[m] * ws[n + o];",
           "float(dots[o][r] - W8A8_SHIFT * wsum[n + o]) * (xs[m] * ws[n + o]);",
           ("tests/test_cpu_kernels.py", "-k", "amx"), needs=("amx_int8",)),
    Mutant("amx-q4-groups-swapped", "the AMX 4-bit path adds each pair of groups' sums in reverse order (its rows "
           "then differ from the vector path's in the last bit)", "serving/engine/rowdot.cpp",
           "for (int h = 0; h < (two ? 2 : 1); ++h) {", "for (int h = two ? 1 : 0; h >= 0; --h) {",
           ("tests/test_cpu_kernels.py", "-k", "amx"), needs=("amx_int8",)),
    Mutant("avx2-q4-scale-spread", "the AVX2 4-bit path multiplies the row scale into both chains before adding them "
           "(a 4-bit layer then gives other bits on an AVX2 CPU)", "serving/engine/rowdot.cpp",
           "_mm256_store_ps(y, _mm256_mul_ps(_mm256_set1_ps(xa[r]), _mm256_add_ps(acc[r], mb[r])));",
           "_mm256_store_ps(y, _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(xa[r]), acc[r]), "
           "_mm256_mul_ps(_mm256_set1_ps(xa[r]), mb[r])));", ("tests/test_cpu_kernels.py", "-k", "paths_agree")),
    Mutant("q4-minimums-in-the-steps-chain", "the AVX-512 4-bit path adds the minimums into the steps' chain "
           "instead of their own (its bits then differ from the AMX, AVX2 and scalar paths')", "serving/engine/rowdot.cpp",
           "      mb[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[r * G + g]), mb[r]);",
           "      acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[r * G + g]), acc[r]);",
           ("tests/test_cpu_kernels.py", "-k", "paths_agree or amx_are"), needs=("avx512_vnni", "avx512bw")),
    Mutant("cache-key-ignores-content", "a cached conversion is found without looking at the weights",
           "serving/engine/weights_cache.py",
           "            h.update(t.view(torch.uint8).numpy().data if t.numel() else b\"\")\n", "",
           ("tests/test_cpu_kernels.py", "-k", "cached_once")),
    Mutant("reuse-any-kept-prefill", "a row's kept prefill is reused for whatever prompt comes next",
           "serving/engine/verifier.py",
           "        if kept is not None and kept[0].shape == prompt.shape and torch.equal(kept[0], prompt):\n",
           "        if kept is not None:\n", ("tests/test_verifier.py", "-k", "reused_prefill")),
    Mutant("reuse-after-failed-admission", "a row whose admission failed after its prefill stays offered for reuse",
           "serving/engine/core.py", "        self.verifier.forget(b)\n", "", ("tests/test_verifier.py", "-k", "admission_failed")),
    # Drafting bugs that greedy identity cannot see (issue 59): the output stays the target's.
    Mutant("ngram-lowest-row", "ngram proposes from the lowest active row's history",
           "serving/engine/drafters/ngram.py", "        return self._rows[row].propose(k)\n",
           "        return self._rows[min(self._rows)].propose(k)\n", ROW_TESTS),
    Mutant("suffix-other-request", "suffix proposes from another row's request",
           "serving/engine/drafters/suffix.py", "        return self.cache.propose(self._request[row], k)[0]\n",
           "        return self.cache.propose(self._request[min(self._request)], k)[0]\n", ROW_TESTS),
    Mutant("draft-prefill-slot-row", "a draft model prefills the engine slot's cache row instead of its own draft row",
           "serving/engine/drafters/model.py", "                self.runner.prefill(self.deferred[r], r)\n",
           "                self.runner.prefill(self.deferred[r], self.owner[r])\n", ROW_TESTS),
    Mutant("fallback-leaks-draft-row", "a fallback switches the row to the target alone before stopping its drafter "
           "(the drafter is never told: its draft row is never freed)", "serving/engine/fallback.py",
           "    stop_drafter()\n    slot.routed_drafter, slot.drafter = slot.drafter, NONE\n",
           "    slot.routed_drafter, slot.drafter = slot.drafter, NONE\n    stop_drafter()\n",
           ROW_TESTS),
    Mutant("auto-shared-scores", "auto keeps one record for every row: one row's verdicts steer another's choices",
           "serving/engine/drafters/auto.py",
           "        self._rows[row] = _Row(hosts, self.policy.scores(), ctx)\n",
           "        self._rows[row] = _Row(hosts, next(iter(self._rows.values())).scores if self._rows "
           "else self.policy.scores(), ctx)\n", AUTO_TESTS),
    Mutant("catch-up-skipped", "a model drafter that skipped steps drafts without reading what it skipped",
           "serving/engine/drafters/model.py", "        self._catch_up(own, state.tokens)\n", "", AUTO_TESTS),
    Mutant("skipping-row-reads-another", "a model drafter's row that skips a step is fed another row's tokens "
           "(its cache is overwritten)", "serving/engine/drafters/model.py",
           "for b in (self.owner[r] for r in range(n_rows))], device=device)", "for b in owner[:n_rows]], device=device)",
           AUTO_TESTS),
    Mutant("features-next-position", "a feature drafter gets the features of the positions after the committed ones",
           "serving/engine/core.py", "hidden=features[b, : len(new)] if", "hidden=features[b, 1 : len(new) + 1] if",
           ("tests/test_target_features.py",)),
    Mutant("features-layer-after", "the captured features are the output of each layer instead of its input",
           "serving/engine/runner.py", "torch.cat([out.hidden_states[i] for i in capture], dim=-1)",
           "torch.cat([out.hidden_states[i + 1] for i in capture], dim=-1)", ("tests/test_target_features.py",)),
    Mutant("eagle3-feature-position", "the EAGLE-3 head pairs the first generated token with the feature of the "
           "position before the prompt's last", "serving/engine/drafters/eagle3.py",
           "self.pending[row] = [ctx.hidden[L - 1 :].to(self.device)]",
           "self.pending[row] = [ctx.hidden[L - 2 : L - 1].to(self.device)]", EAGLE3_TESTS),
    Mutant("eagle3-training-layers", "training reads the target's features one layer above the ones the head "
           "is served with", "training/eagle3.py", "self.features.capture_layers(config.aux_layers)",
           "self.features.capture_layers(tuple(i + 1 for i in config.aux_layers))", EAGLE3_TESTS),
    Mutant("eagle3-stale-kv", "after a rejection the head re-reads the committed pairs one position late, "
           "leaving the chain's entry at the first of them", "serving/engine/drafters/eagle3.py",
           "positions[b] = (seen + torch.arange(W, device=dev)).clamp(max=self.max_len - 1)\n            last[b]",
           "positions[b] = (seen + 1 + torch.arange(W, device=dev)).clamp(max=self.max_len - 1)\n            last[b]",
           EAGLE3_TESTS),
    Mutant("eagle3-vocab-off-by-one", "the draft-to-target vocabulary map is off by one",
           "serving/engine/drafters/eagle3.py", "self._ids = self.head.head_ids.to(self.device)",
           "self._ids = (self.head.head_ids.to(self.device) + 1).clamp(max=vocab_size - 1)", EAGLE3_TESTS),
    # The drafter contract (issue 70): each a one-line change a real bug would look like, caught by the kit.
    Mutant("eagle3-row-budget", "an eagle3 row drafts the step's K whatever its own budget (a k=1 row beside a k=3 "
           "row gets 3 drafts)", "serving/engine/drafters/eagle3.py",
           "n = torch.minimum(budget, torch.full_like(budget, k))", "n = torch.where(budget > 0, k, 0)", KIT_FAST),
    Mutant("eagle3-draw-uniforms", "eagle3 draws its tokens with the acceptance uniforms", "serving/engine/drafters/eagle3.py",
           "drafted.append(sample(q, rand.draft[:, i]))", "drafted.append(sample(q, rand.accept[:, i]))", (KIT,)),
    Mutant("origins-by-budget", "token origins are computed from the row's budget instead of its proposal",
           "serving/engine/core.py", "slot.origins += step_origins(proposer, drafted, accepted, new)",
           "slot.origins += step_origins(proposer, d.budgets[b], accepted, new)", KIT_FAST),
    Mutant("threshold-padding", "threshold verification's lossy accept is applied after the padding mask (a "
           "threshold row with a short proposal accepts padding)", "serving/engine/acceptance.py",
           "    if lossy_accept is not None:\n        accepted |= lossy_accept\n    if n_draft is not None:\n        accepted &= real\n",
           "    if n_draft is not None:\n        accepted &= real\n    if lossy_accept is not None:\n        accepted |= lossy_accept\n",
           KIT_FAST),
    Mutant("auto-late-start", "auto drops the first answer token when it starts a model drafter late",
           "serving/engine/drafters/auto.py", "model.observe(row, tokens[len(state.ctx.prompt):])",
           "model.observe(row, tokens[len(state.ctx.prompt) + 1:])", KIT_FAST),
    Mutant("catch-up-overclaims", "the model drafter's catch-up claims more of the row than it read",
           "serving/engine/drafters/model.py", "self.seen[r] = min(self.seen[r] + width, self.length[r] - 2)",
           "self.seen[r] = self.seen[r] + width", KIT_FAST),
    Mutant("eagle3-commits-on-propose", "eagle3 consumes a row's pending features when it proposes, not when the "
           "step commits (a row re-run after a neighbour's failure has none left)", "serving/engine/drafters/eagle3.py",
           "            self._read_to[b] = seen + m\n",
           "            self._read_to[b] = seen + m\n            self.seen[b], self.pending[b] = seen + m, []\n", KIT_FAST),
    Mutant("auto-scores-on-choose", "auto scores a step's host proposals when it chooses, not when the step commits "
           "(a step re-run after a neighbour's failure is scored twice)", "serving/engine/drafters/auto.py",
           "            state.proposed.append((n, at, proposal))", "            state.scores.propose(n, at, proposal)",
           KIT_FAST),
    # Logits processors under speculation (issue 71).
    Mutant("penalties-ignore-drafts", "a verified position's penalties ignore the draft tokens before it",
           "serving/engine/processors.py", "    if not K:\n        return\n", "    if True:\n        return\n",
           ("tests/test_processors.py",)),
    Mutant("bonus-unprocessed", "the bonus position's p is the unprocessed target's", "serving/engine/speculative.py",
           "        logits = process(logits, sampling.processors, draft_tokens, n_draft)\n",
           "        logits = torch.cat([process(logits, sampling.processors, draft_tokens, n_draft)[:, :-1], logits[:, -1:]], 1)\n",
           ("tests/test_processors.py",)),
    Mutant("accept-q-not-drawing-q", "with processors on, the accept test divides by the processed target's p "
           "instead of the q that drew the token", "serving/engine/speculative.py",
           "    return accept_reject(p, q, draft_tokens, rand.accept[:, :k], rand.next, n_draft, lossy)\n",
           "    return accept_reject(p, p[:, :k] if sampling.processors is not None else q, draft_tokens, "
           "rand.accept[:, :k], rand.next, n_draft, lossy)\n", ("tests/test_processors.py",)),
    Mutant("processors-stop-on-fallback", "a row that falls back to the target alone loses its processors",
           "serving/engine/core.py", "    def _stop_drafter(self, b: int, slot: Slot, finished: bool) -> None:\n",
           "    def _stop_drafter(self, b: int, slot: Slot, finished: bool) -> None:\n        self.processors.stop(b)\n",
           ("tests/test_processors.py", "-k", "falls_back")),
    Mutant("threshold-on-exact-rows", "an exact request in a batch with a threshold one gets the threshold rule too",
           "serving/engine/sampling.py", "p.verification_threshold if p.lossy else 0.0 for p in params",
           "p.verification_threshold for p in params", THRESHOLD_TESTS),
    # JSON schema under speculation (issue 72).
    Mutant("grammar-mask-ignores-drafts", "every verified position is masked as the row's first (the drafts before it unseen)",
           "serving/engine/grammar.py", "                llguidance.numpy.fill_next_token_bitmask(walker, bitmask, b * T + i + 1)\n",
           "                llguidance.numpy.fill_next_token_bitmask(m, bitmask, b * T + i + 1)\n",
           ("tests/test_grammar.py", "-k", "constrained_target or masks_along")),
    Mutant("grammar-padding-allowed", "a GGUF vocabulary's [PAD<id>] rows are allowed inside a JSON string",
           "serving/engine/grammar.py", "            if self.padding:\n", "            if False:\n",
           ("tests/test_grammar.py", "-k", "padding")),
    Mutant("forced-replace-not-join", "a grammar's forced tokens replace the row's drafter's proposal even where it begins with them",
           "serving/engine/drafting.py", "if b not in routes and (host[b] or [])[: len(f)] != f:", "if b not in routes:",
           ("tests/test_grammar.py", "-k", "carries_on")),
    Mutant("tool-call-unclosed-counts", "a tool call the model opened and never closed is parsed as a call",
           "serving/server/tools.py", 're.escape(OPEN) + r"\\s*(.*?)\\s*" + re.escape(CLOSE)',
           're.escape(OPEN) + r"\\s*(.*?)\\s*(?:" + re.escape(CLOSE) + "|$)"', ("tests/test_tools.py", "-m", "unit")),
    Mutant("fenced-example-counts", "JSON followed by more text (an example) is parsed as a call",
           "serving/server/tools.py", "if not found or m.end() != end or", "if not found or", ("tests/test_tools.py", "-m", "unit")),
    Mutant("fair-queue-fifo", "the next free slot goes to the oldest line, not the client with the fewest running",
           "serving/server/admission.py", "key=lambda c: (self._running.get(c, 0), self._served.get(c, -1))",
           "key=lambda c: 0", ("tests/test_admission.py", "-m", "unit")),
    Mutant("missing-manifest-resumes", "a checkpoint whose manifest was deleted resumes unchecked without the flag",
           "training/checkpoint.py", "        if unchecked:\n            return False\n", "        return False\n",
           ("tests/test_checkpoint.py",)),
    Mutant("damaged-checksum-key-legacy", "a row whose checksum field was damaged reads as an unchecked older row",
           "routing/rows.py", "a != t for a, t in zip(tail, _TAIL)) <= 1:", "a != t for a, t in zip(tail, _TAIL)) <= -1:",
           ("tests/test_routing_config.py", "-k", "single_byte")),
    Mutant("lone-row-capped", "goodput caps a row alone in its step (the 0.5B lost its batch-1 gain so)",
           "serving/engine/k_policy.py", "if sum(slot is not None for slot in slots) < 2:", "if False:",
           ("tests/test_goodput.py",)),
]


def copy_tree(dest: Path) -> None:
    """Tracked files plus untracked, unignored ones, as they are in the working tree."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def tree_env(tree: Path) -> dict:
    """The copy's packages first on the path, ahead of an editable install of the working tree."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}


def run_mutant(m: Mutant, tree: Path, timeout_s: float) -> tuple[str, float, str]:
    """Returns (outcome, seconds, last output line): killed, survived, stale, timeout, no tests or
    not run here."""
    path = tree / m.path
    original = path.read_text()
    if original.count(m.old) != 1:
        return "stale", 0.0, f"{m.path}: the mutant's text occurs {original.count(m.old)} times, not once"
    have = cpu_flags() if m.needs else set()
    missing = [f for f in m.needs if f not in have]
    if missing:
        return "not run here", 0.0, f"this CPU has no {', '.join(missing)}"
    path.write_text(original.replace(m.old, m.new))
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", *m.tests],
                              cwd=tree, env=tree_env(tree), capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - started, ""
    finally:
        path.write_text(original)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    last = lines[-1] if lines else proc.stderr.strip().splitlines()[-1:]
    if proc.returncode == 5:  # no test selected: a renamed test must not count as a kill
        return "no tests", time.perf_counter() - started, str(last)
    if proc.returncode == 0 and " skipped" in str(last) and " passed" not in str(last):
        # Every selected test skipped: the mutated code does not run on this machine (AMX on a CPU
        # without it). Neither a kill nor a survival.
        return "not run here", time.perf_counter() - started, str(last)
    return ("killed" if proc.returncode != 0 else "survived"), time.perf_counter() - started, str(last)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant")
    args = ap.parse_args(argv)
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        ap.error(f"unknown mutant {unknown[0]!r}; known: {', '.join(known)}")
    chosen = [known[n] for n in args.names] or MUTANTS
    if args.list:
        for m in chosen:
            needs = f"; needs CPU flags {', '.join(m.needs)}" if m.needs else ""
            print(f"{m.name}: {m.why}\n    {m.path}; tests: {' '.join(m.tests)}{needs}")
        return 0
    with tempfile.TemporaryDirectory(prefix="choral-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        baseline = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--co",
                                   "tests/test_distribution.py"], cwd=tree, env=tree_env(tree), capture_output=True)  # fmt: skip
        if baseline.returncode != 0:
            print("the copied tree does not collect its tests:\n" + baseline.stdout.decode()[-2000:])
            return 2
        print(f"| mutant | outcome | seconds | pytest |\n|---|---|---|---|", flush=True)
        bad = not_here = 0
        for m in chosen:
            outcome, seconds, last = run_mutant(m, tree, args.timeout)
            not_here += outcome == "not run here"
            bad += outcome not in ("killed", "not run here")
            print(f"| {m.name} | {outcome} | {seconds:.0f} | {last} |", flush=True)
    ran = len(chosen) - not_here
    print(f"\n{ran - bad} of {ran} mutants killed, {bad} survived (or stale, or timed out)"
          + (f"; {not_here} not run here (their code does not run on this machine)" if not_here else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
