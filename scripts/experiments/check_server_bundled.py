"""Check a running `serve` through the official openai client: completion, chat and streaming,
greedy outputs compared with each other, with the target alone (forced draft "none") and with
`spec-generate` on the bundled pair.

    serve --router runs/main/router/router.pt --port 8311 &
    python scripts/experiments/check_server_bundled.py --url http://127.0.0.1:8311
"""
import argparse
import json
import subprocess

from openai import OpenAI

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--url", default="http://127.0.0.1:8311")
args = ap.parse_args()
c = OpenAI(base_url=f"{args.url}/v1", api_key="none", timeout=600)
model = c.models.list().data[0].id
prompt = "def fibonacci(n: int) -> int:\n"
msgs = [{"role": "user", "content": "Name two prime numbers and explain why they are prime."}]
out = {}
r = c.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
out["completion"] = (r.choices[0].text, r.model_extra["choral"])
s = "".join(ch.choices[0].text for ch in c.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0, stream=True))
out["completion_stream_equal"] = s == r.choices[0].text
ch = c.chat.completions.create(model=model, messages=msgs, max_tokens=32, temperature=0)
chs = "".join((x.choices[0].delta.content or "") for x in c.chat.completions.create(model=model, messages=msgs, max_tokens=32, temperature=0, stream=True) if x.choices)
out["chat"] = (ch.choices[0].message.content, ch.model_extra["choral"])
out["chat_stream_equal"] = chs == ch.choices[0].message.content
alone = c.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0, extra_body={"draft": "none"}).choices[0].text
out["completion_equals_target_alone"] = alone == r.choices[0].text
sg = subprocess.run(["spec-generate", "--target", "qwen2.5-coder-1.5b-instruct", "--draft", "qwen2.5-coder-0.5b-instruct", "--prompt", prompt, "--max-new-tokens", "32", "--json"], capture_output=True, text=True)
sg_text = json.loads(sg.stdout.strip().splitlines()[-1])["text"]
out["completion_equals_spec_generate"] = sg_text == r.choices[0].text
print(json.dumps(out, indent=1))
