"""The EAGLE-3 head and its drafter (issue 60): the speculators folder round trip; the training-time
test computes what a served chain computes; training reads bitwise the features the engine serves;
``eagle3`` rows in any batch mix keep the target's greedy output (fp32, int8 and q4 targets), seeded
output does not depend on the batch, sampled output follows the target's distribution; the
drafter's incremental cache holds what a fresh read of the row's pairs gives after every rejection."""

from __future__ import annotations

import json

import pytest
import torch

from serving.engine import cpu_kernels
from serving.engine.core import SpeculativeEngine
from serving.engine.drafters.base import DraftBatch, RowContext
from serving.engine.drafters.eagle3 import Eagle3Drafter
from serving.engine.drafters.ngram import NgramDrafter
from serving.engine.eagle3 import Eagle3Config, Eagle3Head, is_eagle3_folder
from serving.engine.engine_settings import EngineConfig
from serving.engine.request import Request
from serving.engine.runner import ModelRunner
from serving.engine.sampling import SamplingParams, SamplingTensors, probs_from_logits
from serving.engine.speculative import step_uniforms
from tests.conftest import tiny_qwen2
from tests.test_engine_tiny import hf_greedy, ragged_prompts

AUX = (1, 2, 3)
needs_kernels = pytest.mark.skipif(cpu_kernels._rowdot_ext() is None, reason="rowdot kernel cannot be built here")


def peaked_target(seed: int = 1):
    """A 4-layer tiny target with peaked next-token distributions that depend mostly on the last
    token (its layers write little into the residual stream): a small head learns it in seconds."""
    target = tiny_qwen2(seed, layers=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(8)
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return target


def random_head(target, seed: int = 0, vocab: int = 200, scale: float = 0.1) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target.config, aux_layers=AUX, draft_vocab_size=vocab),
                      embed=target.model.embed_tokens.weight)  # fmt: skip
    for name, p in head.named_parameters():
        if p.requires_grad and p.dim() > 1:
            torch.nn.init.normal_(p, std=scale)
    head.set_draft_vocab(list(range(target.config.vocab_size - vocab, target.config.vocab_size)))
    return head.eval()


def distilled_head(target, steps: int = 150, seed: int = 0) -> Eagle3Head:
    """A head trained on the target's own greedy text with the training-time test (the recipe's
    pieces, without the recipe): it drafts well enough that steps accept and reject."""
    from training.eagle3 import TTTLoss, ttt_forward

    from training.eagle3 import init_from_target

    head = random_head(target, seed=seed, vocab=target.config.vocab_size - 3, scale=0.02)
    head.set_draft_vocab(list(range(3, target.config.vocab_size)))
    init_from_target(head, target, layer_too=False)
    head.train()
    runner = ModelRunner(target, batch_size=1, max_len=64)
    runner.capture_layers(AUX)
    rows = [torch.tensor(p + hf_greedy(target, p, 40))[:48] for p in ragged_prompts(16, seed=seed + 5)]
    data = []
    for row in rows:
        logits, feats = runner.features(row[None])
        data.append((row[None], feats, logits[..., head.head_ids]))
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    loss_fn = TTTLoss(decay=0.8)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids, feats, teacher = data[int(torch.randint(len(data), (1,), generator=g))]
        loss, _ = loss_fn(ttt_forward(head, feats, ids, 3), teacher, torch.ones_like(ids, dtype=torch.bool))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target_and_head(tokenizer):
    target = peaked_target()
    return target, distilled_head(target)


# ---- the folder ------------------------------------------------------------------------------


@pytest.mark.unit
def test_a_speculators_folder_round_trips_config_weights_and_vocabulary(tmp_path):
    target = tiny_qwen2(1, layers=4)
    head = random_head(target)
    head.save(tmp_path / "head")
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["speculators_config"]["algorithm"] == "eagle3"
    assert raw["eagle_aux_hidden_state_layer_ids"] == list(AUX) and raw["draft_vocab_size"] == 200
    assert is_eagle3_folder(tmp_path / "head") and not is_eagle3_folder(tmp_path)
    with pytest.raises(ValueError, match="embed_tokens.weight: pass the target's embeddings"):
        Eagle3Head.from_folder(tmp_path / "head")
    back = Eagle3Head.from_folder(tmp_path / "head", embed=target.model.embed_tokens.weight)
    assert back.config == head.config
    assert torch.equal(back.head_ids, head.head_ids) and torch.equal(back.t2d, head.t2d)
    tokens, feats = torch.randint(3, 300, (1, 6)), torch.randn(1, 6, 3 * 64)
    positions = torch.arange(6)[None]
    a, _ = head.step(tokens, feats, positions, head.new_cache(1, 16))
    b, _ = back.step(tokens, feats, positions, back.new_cache(1, 16))
    assert torch.equal(a, b)


@pytest.mark.unit
def test_a_folder_of_another_kind_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "mlp_speculator"}))
    with pytest.raises(ValueError, match="'mlp_speculator', not 'eagle3'"):
        Eagle3Head.from_folder(tmp_path)


# ---- training computes what serving computes -------------------------------------------------


@pytest.mark.unit
def test_the_training_time_test_is_the_served_chain():
    """Unrolled step j at row p (training) equals the served head after reading the pairs up to p
    and chaining j steps on its own states (serving)."""
    from training.eagle3 import ttt_forward

    target = tiny_qwen2(1, layers=4)
    head = random_head(target)
    tokens, feats = torch.randint(3, 300, (1, 12)), torch.randn(1, 12, 3 * 64)
    steps = ttt_forward(head, feats, tokens, 3)
    for p in (0, 4, 8):
        cache = head.new_cache(1, 32)
        logits, state = head.step(tokens[:, 1 : p + 2], feats[:, : p + 1], torch.arange(p + 1)[None], cache)
        torch.testing.assert_close(logits[:, -1], steps[0][:, p], rtol=1e-5, atol=1e-5)
        state = state[:, -1:]
        for j in (1, 2):
            logits, state = head.step(tokens[:, p + 1 + j : p + 2 + j], state, torch.tensor([[p + j]]), cache)
            torch.testing.assert_close(logits[:, 0], steps[j][:, p], rtol=1e-4, atol=1e-4)


@pytest.mark.unit
@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=needs_kernels)])
def test_training_reads_bitwise_the_features_the_engine_serves(kernels):
    """``ModelRunner.features`` (what training reads) and the engine's prefill features are the
    same forward: bitwise equal, on the Hugging Face forward and on the q4 lean forward."""
    target = tiny_qwen2(2, layers=4)
    if kernels:
        cpu_kernels.prepare_for_cpu(target, weights="q4", token_counts=(1, 5), cache=False, requantize=True)
    runner = ModelRunner(target, batch_size=2, max_len=64)
    runner.capture_layers(AUX)
    ids = torch.randint(3, 300, (1, 20))
    logits, feats = runner.features(ids)
    last = runner.prefill(ids, slot=1)
    assert torch.equal(feats, runner.prefill_features)
    torch.testing.assert_close(logits[:, -1:], last)  # the head's matmul over L rows or one: rounding only


# ---- the drafter in the engine ---------------------------------------------------------------


def mixed_engine(target, tokenizer, head, batch: int, k: int = 3) -> SpeculativeEngine:
    drafters = {"eagle3": Eagle3Drafter(head), "ngram": NgramDrafter(), "none": None}
    return SpeculativeEngine(target, tokenizer, config=EngineConfig(max_batch_size=batch, max_len=128, k=k), drafters=drafters)


NAMES = ["eagle3", "ngram", "eagle3", "none", "eagle3"]


@pytest.mark.integration
def test_eagle3_rows_in_a_mixed_batch_are_the_targets_greedy_output(target_and_head, tokenizer):
    target, head = target_and_head
    prompts = ragged_prompts(10, seed=41)
    requests = lambda: [Request(p, max_new_tokens=24, drafter=NAMES[i % len(NAMES)]) for i, p in enumerate(prompts)]  # noqa: E731
    outs = mixed_engine(target, tokenizer, head, batch=4).generate(requests())
    single = mixed_engine(target, tokenizer, head, batch=1)
    alone = [single.generate([r])[0] for r in requests()]
    for prompt, out, one in zip(prompts, outs, alone):
        assert out.token_ids == hf_greedy(target, prompt, 24) == one.token_ids
    heads = [o.stats for o in outs if o.stats["drafter"] == "eagle3"]
    accepted = sum(s["accepted"] for s in heads) / sum(s["drafted"] for s in heads)
    assert 0.05 < accepted < 1.0  # the trained head's drafts are accepted, and rejected


@pytest.mark.integration
@needs_kernels
@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_on_the_cpu_kernels_eagle3_rows_keep_the_low_bit_targets_output(target_and_head, tokenizer, weights):
    """A target at int8 or q4 with a head at the same precision: every row is that target's own
    greedy output (the engine's target alone, same kernels), in a batch or alone."""
    import copy

    base, trained = target_and_head
    target = cpu_kernels.prepare_for_cpu(copy.deepcopy(base), weights=weights, token_counts=(1, 2, 3, 4), cache=False,
                                         requantize=True)  # fmt: skip
    head = copy.deepcopy(trained)
    assert head.use_kernels(weights)
    prompts = ragged_prompts(8, seed=43)
    alone = SpeculativeEngine(target, tokenizer, config=EngineConfig(max_batch_size=1, max_len=128, k=0))
    reference = [alone.generate([Request(p, max_new_tokens=20)])[0].token_ids for p in prompts]
    outs = mixed_engine(target, tokenizer, head, batch=4).generate(
        [Request(p, max_new_tokens=20, drafter=NAMES[i % len(NAMES)]) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in outs] == reference
    assert sum(o.stats["accepted"] for o in outs if o.stats["drafter"] == "eagle3") > 0


@pytest.mark.integration
@needs_kernels
def test_seeded_eagle3_output_does_not_depend_on_the_batch(target_and_head, tokenizer):
    import copy

    base, trained = target_and_head
    target = cpu_kernels.prepare_for_cpu(copy.deepcopy(base), weights="fp32", token_counts=(1, 2, 3, 4), cache=False)
    head = copy.deepcopy(trained)
    assert head.use_kernels("int8")
    prompts = ragged_prompts(6, seed=44)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    requests = lambda: [Request(p, max_new_tokens=16, drafter=NAMES[i % len(NAMES)], params=params) for i, p in enumerate(prompts)]  # noqa: E731
    batched = mixed_engine(target, tokenizer, head, batch=4).generate(requests())
    single = mixed_engine(target, tokenizer, head, batch=1)
    assert [o.token_ids for o in batched] == [single.generate([r])[0].token_ids for r in requests()]


class CheckedDrafter(Eagle3Drafter):
    """Records, at every step, the drafter's first-token distribution beside a fresh read of the
    row's committed pairs by the same head in a cache of its own (the reference)."""

    def __init__(self, head):
        super().__init__(head)
        self.feats: dict[int, list[torch.Tensor]] = {}
        self.checks: list[tuple[torch.Tensor, torch.Tensor]] = []

    def start(self, row, ctx):
        super().start(row, ctx)
        self.feats[row] = [ctx.hidden]

    def observe(self, row, new_tokens, hidden=None):
        super().observe(row, new_tokens, hidden)
        if hidden is not None and hidden.shape[0]:
            self.feats[row].append(hidden)

    def propose_rows(self, batch):
        proposal = super().propose_rows(batch)
        for b, budget in enumerate(batch.budgets):
            if budget == 0 or b not in self.length:
                continue
            n = self.length[b]
            tokens = batch.state.tokens[b, 1:n][None]  # [1, n-1] x_1..x_{n-1}
            feats = torch.cat(self.feats[b])[: n - 1][None]  # [1, n-1, 3H] f_0..f_{n-2}
            cache = self.head.new_cache(1, self.max_len)
            logits, _ = self.head.step(tokens, feats, torch.arange(n - 1)[None], cache)
            full = torch.full((1, 1, self.vocab_size), float("-inf"))
            full[0, 0, self.head.head_ids] = logits[0, -1]
            q = probs_from_logits(full, batch.sampling.rows(torch.tensor([b])))[0, 0]  # [V]
            self.checks.append((q, proposal.q[b, 0]))
        return proposal


@pytest.mark.integration
def test_after_every_rejection_the_heads_cache_holds_the_committed_pairs(target_and_head, tokenizer):
    """The drafter's incremental reads (prompt, then each step's committed tokens, the chain's own
    entries left behind by rejections) give the same first draft distribution as a fresh read of
    every committed pair, at every step of every row, in a mixed batch."""
    target, head = target_and_head
    drafter = CheckedDrafter(head)
    engine = SpeculativeEngine(target, tokenizer, config=EngineConfig(max_batch_size=4, max_len=128, k=3),
                               drafters={"eagle3": drafter, "ngram": NgramDrafter()})  # fmt: skip
    prompts = ragged_prompts(6, seed=45)
    params = SamplingParams(temperature=1.0, seed=3)  # q is the head's whole distribution, not a greedy one-hot
    outs = engine.generate([Request(p, max_new_tokens=20, drafter=["eagle3", "ngram"][i % 2], params=params)
                            for i, p in enumerate(prompts)])  # fmt: skip
    rows = [o.stats for o in outs if o.stats["drafter"] == "eagle3"]
    assert sum(s["accepted"] for s in rows) < sum(s["drafted"] for s in rows)  # rejections happened
    assert len(drafter.checks) > 10
    for reference, served in drafter.checks:
        torch.testing.assert_close(served, reference, rtol=1e-4, atol=1e-5)


# ---- sampling follows the target ------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.slow  # a minute: 12,000 rows through the drafter's per-row bookkeeping
def test_sampled_eagle3_drafts_keep_the_target_distribution():
    """12,000 rows of a Markov target over 5 tokens, drafted by an EAGLE-3 head whose vocabulary
    leaves one token out (q = 0 there), K = 3, verified by the engine's own ``verify_half``: the
    joint distribution of three tokens passes the chi-square test of tests/test_distribution.py."""
    from serving.engine.speculative import verify_half
    from tests.stubs import MarkovStub, state_for
    import tests.test_distribution as dist
    from tests.test_distribution import M, V, exact_distribution, tables

    N = 12_000

    torch.manual_seed(0)
    p_table, _ = tables(3)
    cfg = Eagle3Config(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                       vocab_size=V, draft_vocab_size=V - 1, target_hidden_size=8, aux_layers=(0,))  # fmt: skip
    head = Eagle3Head(cfg)
    for p in head.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=1.0)
    head.set_draft_vocab([0, 1, 2, 4])
    table = torch.randn(V, 8)  # the "target's features" of each token (a stub target has none)
    K, params = 3, SamplingParams(temperature=0.9, top_k=4)
    target = MarkovStub(p_table)
    state = state_for([[0, 1]] * N, capacity=2 + M + K + 8, limit=M + K + 4, eos=[], device="cpu")
    drafter = Eagle3Drafter(head)
    drafter.bind(batch_size=N, max_len=2 + M + K + 8, vocab_size=V)
    for b in range(N):
        drafter.start(b, RowContext(b, [0, 1], None, False, table[[0, 1]]))
    sampling = SamplingTensors.build([params] * N, "cpu")
    generators = [torch.Generator().manual_seed(900 + i) for i in range(N)]
    while int(state.lengths.min()) < 2 + M:
        rand = step_uniforms(generators, [K] * N, K, "cpu")
        before = state.lengths.clone()
        proposal = drafter.propose_rows(DraftBatch([K] * N, state, sampling, rand, V, (N,), k_max=K))
        verify_half(target, state, sampling, rand, proposal.tokens, proposal.q, n_draft=proposal.n)
        for b in range(N):
            new = state.tokens[b, int(before[b]) : int(state.lengths[b])]
            drafter.observe(b, new.tolist(), hidden=table[state.tokens[b, int(before[b]) - 1 : int(state.lengths[b]) - 1]])
    samples = state.tokens[:, 2 : 2 + M]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "N", N)  # p_value's sample count
        assert dist.p_value(samples, exact_distribution(p_table, 1, params)) > 1e-3


# ---- train-draft end to end ------------------------------------------------------------------


@pytest.mark.e2e
def test_train_draft_eagle3_learns_saves_a_folder_the_engine_serves_and_reads_the_served_features(tmp_path, tokenizer):
    """``train-draft`` with ``model.kind: eagle3`` on a tiny target: the loss falls, held-out
    acceptance rises, best/ is a speculators folder ``load_engine`` serves with the target's own
    greedy output, and the recipe's training features are the engine's prompt features."""
    from serving.config import load_config
    from serving.engine.engine_settings import EngineSettings
    from serving.engine.loader import load_engine
    from tests.test_train_draft import tiny_config
    from training.config import TrainDraftConfig
    from training.eagle3 import Eagle3Recipe
    from training.recipes import train

    peaked_target().save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    folder = str(tmp_path / "target")
    out = tmp_path / "run"
    config = tiny_config({"target": folder}, out, model={"kind": "eagle3", "target": folder, "draft_vocab": 300},
                         data={"domain": "code", "n_docs": 40, "seq_len": 48, "max_rows": 16, "on_policy": True,
                               "on_policy_prompts": 48, "on_policy_new_tokens": 40},
                         optim={"lr": 3e-3, "warmup_steps": 2, "schedule": "constant"},
                         train={"max_steps": 40, "batch_size": 4, "device": "cpu", "log_every": 1},
                         eval={"every": 40, "prompts": 3, "max_new_tokens": 16, "engine": {"k": 3}},
                         output={"dir": str(out), "save_every": 20})  # fmt: skip
    cfg = load_config(TrainDraftConfig, config, ["eagle3.aux_layers=[1, 2, 3]", "eagle3.intermediate_size=128"])
    progress = train(cfg)
    losses = [h["loss"] for h in progress["history"] if "loss" in h]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    # Agreement with the target's next token on held-out rows (served acceptance on the long
    # HumanEval prompts is no measure for a head trained on 48-token rows of a random target).
    assert progress["after"]["val_agreement"] > progress["before"]["val_agreement"] + 0.2
    assert is_eagle3_folder(out / "best") and (out / "final" / "model.safetensors").exists()

    settings = EngineSettings(device="cpu", k=3, max_len=256)
    loaded = load_engine(settings, folder, {"eagle3": str(out / "best")})
    prompts = ragged_prompts(3, seed=47)
    outs = loaded.engine.generate([Request(p, max_new_tokens=16) for p in prompts])
    assert [o.token_ids for o in outs] == [hf_greedy(loaded.target, p, 16) for p in prompts]

    from tests.conftest import load_script

    load_script("scripts/experiments/eagle3_curve.py").main([str(out), "--out", str(tmp_path / "curve.png")])
    assert (tmp_path / "curve.png").exists()

    recipe = Eagle3Recipe(cfg)
    recipe.setup()
    ids = recipe.val_ids[:1]  # [1, L]
    feats, _ = recipe.teacher_rows(ids)
    loaded.engine.generate([Request(ids[0].tolist(), max_new_tokens=1)])
    # The same layers and position, to rounding: the engine's prefill may run at another width (a
    # prompt bucket) than training's row; bitwise equality of the one forward at one width is
    # test_training_reads_bitwise_the_features_the_engine_serves.
    torch.testing.assert_close(feats[0], loaded.engine.verifier.prompt_features, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_export_vllm_writes_an_eagle3_speculative_config_for_a_head_folder(model_dirs, tmp_path):
    """A head folder becomes vLLM's ``{"method": "eagle3", "model": DIR}``; a head of another
    target's width is refused by name."""
    from tests.conftest import load_script

    module = load_script("scripts/export_vllm.py")
    target = str(model_dirs["target"])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target)
    head = Eagle3Head(Eagle3Config.for_target(config, aux_layers=(0, 1), draft_vocab_size=100))
    head.save(tmp_path / "head")
    spec = module.draft_spec(target, str(tmp_path / "head"), 3, "draft")
    assert spec == {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    raw["target_hidden_size"] = 4096
    (tmp_path / "head" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(SystemExit, match="width 4096"):
        module.draft_spec(target, str(tmp_path / "head"), 3, "draft")


@pytest.mark.unit
def test_an_eagle3_training_config_names_what_it_needs():
    from serving.config import ConfigError, load_config
    from training.config import TrainDraftConfig

    with pytest.raises(ConfigError, match="model.kind=eagle3 needs model.draft_vocab"):
        load_config(TrainDraftConfig, None, ["model.kind=eagle3"])
    with pytest.raises(ConfigError, match="ttt_steps=0 must be >= 1"):
        load_config(TrainDraftConfig, None, ["model.kind=eagle3", "model.draft_vocab=100", "eagle3.ttt_steps=0"])


@pytest.mark.unit
def test_the_quick_profile_applies_over_the_file_and_an_unknown_one_is_refused(capsys):
    import argparse

    from serving.config import ConfigError, load_config
    from training.cli import with_profile
    from training.config import TrainDraftConfig

    path = "configs/eagle3_code.yaml"
    cfg = load_config(TrainDraftConfig, path, [])
    quick = with_profile(cfg, argparse.Namespace(profile="quick", config=path, overrides=["train.max_steps=7"]))
    assert quick.train.device == "cpu" and quick.train.time_budget_min <= 60 and quick.train.max_steps == 7
    assert cfg.train.time_budget_min is None and quick.model.kind == "eagle3"
    with pytest.raises(ConfigError, match=r"no such profile; it has \['quick'\]"):
        with_profile(cfg, argparse.Namespace(profile="slow", config=path, overrides=[]))


@pytest.mark.integration
def test_auto_beside_an_eagle3_head_chooses_among_the_others_and_refuses_it_by_name(tokenizer):
    """Every served engine holds ``auto``: with a head beside it, auto chooses among the host
    drafters and draft models (it does not price a head yet) and says so when asked for the head."""
    from serving.engine.drafters.auto import AutoDrafter

    target = tiny_qwen2(1, layers=4)
    head = random_head(target)
    engine = SpeculativeEngine(target, tokenizer, config=EngineConfig(max_batch_size=2, max_len=96, k=3),
                               drafters={"eagle3": Eagle3Drafter(head), "ngram": NgramDrafter(), "auto": AutoDrafter()})  # fmt: skip
    prompt = ragged_prompts(1, seed=48)[0]
    [out] = engine.generate([Request(prompt, max_new_tokens=12, drafter="auto")])
    assert out.token_ids == hf_greedy(target, prompt, 12)
    with pytest.raises(ValueError, match=r"auto: drafters \['eagle3'\] are eagle3 drafters"):
        SpeculativeEngine(target, tokenizer, config=EngineConfig(max_batch_size=2, max_len=96, k=3),
                          drafters={"eagle3": Eagle3Drafter(head), "auto": AutoDrafter(("eagle3",))})  # fmt: skip


# ---- the experiment scripts on tiny cases ----------------------------------------------------


@pytest.mark.integration
def test_bench_eagle3_runs_a_tiny_head_beside_the_other_drafters(tmp_path, tokenizer):
    """scripts/experiments/bench_eagle3.py on a tiny target, draft and head: every output is the
    target's, and the tables carry every drafter and the step costs."""
    from tests.conftest import load_script, perturbed

    target = peaked_target()
    target.config.max_position_embeddings = 4096
    for name, model in (("target", target), ("draft", perturbed(target, 0.5, seed=1))):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    random_head(target).save(tmp_path / "head")
    module = load_script("scripts/experiments/bench_eagle3.py")
    module.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--head", f"code={tmp_path / 'head'}",
                 "--per-domain", "1", "--max-tokens", "6", "--steps", "2", "--out", str(tmp_path / "out")])  # fmt: skip
    result = json.loads((tmp_path / "out" / "eagle3.json").read_text())
    assert all(r["identical"] for r in result["runs"])
    assert {r["drafter"] for r in result["rows"]} == {"none", "ngram", "suffix", "draft", "code"}
    assert result["step_ms"]["code_b8"] > 0 and "| code |" in (tmp_path / "out" / "eagle3.md").read_text()


VLLM_PYTHON = __import__("os").environ.get("CHORAL_VLLM_PYTHON")


@pytest.mark.e2e
@pytest.mark.skipif(VLLM_PYTHON is None, reason="vLLM is not installed (set CHORAL_VLLM_PYTHON to its venv's python)")
def test_vllm_loads_a_head_train_draft_wrote(tmp_path, tokenizer):
    """scripts/experiments/vllm_eagle3_check.py with vLLM's own interpreter on a tiny target and a
    head saved the way train-draft saves it: vLLM either decodes with it, output equal to its target
    alone, or the script records vLLM's exact reason."""
    import subprocess

    target = peaked_target()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    random_head(target).save(tmp_path / "head")
    ran = subprocess.run([VLLM_PYTHON, "scripts/experiments/vllm_eagle3_check.py", "--target", str(tmp_path / "target"),
                          "--head", str(tmp_path / "head"), "--max-tokens", "8", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "vllm_eagle3.json").read_text())
    assert result.get("identical") is True or result.get("eagle3_error")
