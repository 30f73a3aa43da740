"""``serve --backend vllm`` in front of real vLLM replicas (tier ``vllm``): a tiny random Qwen2 in
two pools, the target alone and ``ngram``, launched from the commands ``scripts/export_vllm.py``
writes. Runs where vLLM is installed: importable here, or in its own virtualenv named by
``CHORAL_VLLM_PYTHON`` (vLLM's CPU build pins its own packages, so it usually lives apart:
``CHORAL_VLLM_PYTHON=/path/to/venv-vllm/bin/python pytest -m vllm``)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.test_fleet_front import fleet_router, free_port, front  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("CHORAL_VLLM_PYTHON") or (sys.executable if importlib.util.find_spec("vllm") else None)
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(VLLM_PYTHON is None, reason="vLLM is not installed (set CHORAL_VLLM_PYTHON to its venv's python)"),
]


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory, tokenizer) -> Path:
    """A tiny Qwen2 whose head size vLLM's CPU attention supports (64), saved with the test tokenizer."""
    torch_seed = 0
    import torch

    torch.manual_seed(torch_seed)
    config = Qwen2Config(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=512, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False, torch_dtype="bfloat16")  # fmt: skip
    path = tmp_path_factory.mktemp("vllm-model") / "tiny-target"
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class Replicas:
    """The fleet's replicas, started from export_vllm.py's scripts with the vLLM interpreter."""

    def __init__(self, fleet: Path, out: Path) -> None:
        subprocess.run([sys.executable, "scripts/export_vllm.py", "--fleet", str(fleet), "--platform", "cpu",
                        "--max-model-len", "256", "--out", str(out)], cwd=ROOT, check=True, capture_output=True)  # fmt: skip
        env = dict(os.environ, VLLM_VENV=str(Path(VLLM_PYTHON).parent.parent))
        self.fleet = yaml.safe_load((out / "fleet.yaml").read_text())
        self.procs = {}
        for pool in self.fleet["pools"]:
            for i, url in enumerate(pool["replicas"]):
                script = out / f"{pool['name']}-{i}.sh"
                # Tests skip torch.compile (a minute per replica on a small CPU).
                script.write_text(script.read_text().replace(" --max-model-len", " --enforce-eager --max-model-len"))
                log = open(out / f"{pool['name']}-{i}.log", "w")
                self.procs[url] = subprocess.Popen(["sh", str(script)], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait(out)
        except BaseException:
            self.stop()
            raise

    def _wait(self, out: Path) -> None:
        deadline = time.time() + 600
        for url, proc in self.procs.items():
            while True:
                try:
                    if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                        break
                except OSError:
                    pass
                assert proc.poll() is None, f"vLLM at {url} exited: see {out}"
                assert time.time() < deadline, f"vLLM at {url} did not start in 10 minutes"
                time.sleep(1)

    def kill(self, url: str) -> None:
        """The replica and every process it started (vLLM's engine core and workers)."""
        import psutil

        proc = self.procs[url]
        try:
            tree = psutil.Process(proc.pid)
            for p in [*tree.children(recursive=True), tree]:
                p.kill()
        except psutil.NoSuchProcess:
            pass
        proc.wait(30)

    def stop(self) -> None:
        for url, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(url)


@pytest.mark.e2e
def test_the_front_over_real_vllm_replicas(vllm_model, fleet_router, tmp_path):  # noqa: F811
    plain_url, ngram_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"model": str(vllm_model), "health_interval_s": 0.5, "pools": [
        {"name": "plain", "replicas": [plain_url]},
        {"name": "ngram", "drafter": "code", "replicas": [ngram_url], "step_cost": 0.5,
         "speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}},
    ]}))  # fmt: skip
    replicas = Replicas(fleet, tmp_path / "launch")
    srv = None
    try:
        srv = front(tmp_path / "launch" / "fleet.yaml", fleet_router, "request_timeout_s=120")
        direct = openai.OpenAI(base_url=f"{plain_url}/v1", api_key="x", max_retries=0)
        prompts = ["def add(a, b):\n    return a + b\ndef add(a, b):", "The quick brown fox", "What is 12 + 30?"]
        for prompt in prompts:  # greedy: routed (ngram pool) output equals vLLM's target alone
            alone = direct.completions.create(model=str(vllm_model), prompt=prompt, max_tokens=24, temperature=0)
            routed = srv.client.completions.create(model=srv.model, prompt=prompt, max_tokens=24, temperature=0)
            assert routed.model_extra["choral"]["pool"] == "ngram"
            assert routed.choices[0].text == alone.choices[0].text, prompt
        streamed = srv.client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=8, temperature=0, stream=True)  # fmt: skip
        assert [ch for ch in streamed if ch.choices and ch.choices[0].finish_reason][0].model_extra["choral"]["pool"] == "ngram"

        def run(_):
            try:
                out = srv.client.completions.create(model=srv.model, prompt="x", max_tokens=200, temperature=0,
                                                    extra_body={"draft": "code", "ignore_eos": True})  # fmt: skip
                return out.model_extra["choral"]["pool"]
            except openai.APIStatusError as e:
                return e.status_code

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(run, i) for i in range(4)]
            time.sleep(1.0)
            replicas.kill(ngram_url)
            results = [f.result(timeout=120) for f in futures]  # none hangs
        assert all(r in (502, "ngram") for r in results), results
        out = srv.client.completions.create(model=srv.model, prompt="def f():", max_tokens=4)
        assert out.model_extra["choral"]["pool"] == "plain"
        assert out.model_extra["choral"]["fallback"] == [{"pool": "ngram", "reason": "down"}]
    finally:
        if srv is not None:
            srv.stop()
        replicas.stop()
        shutil.rmtree(tmp_path / "launch", ignore_errors=True)
