"""The README's screenshot of ``choral-demo``: the page on the bundled pair, driven in headless
Chromium through one prompt with a forced drafter, captured once both runs have finished.

    python scripts/experiments/demo_screenshot.py --drafter draft --out docs/demo.png

Starts ``serve`` in this process as ``choral-demo`` does without ``--url`` (an untrained router
over the bundled 0.5B draft, which the page forces by name), then the page, then Chromium
(Debian's ``chromium`` and ``chromium-driver``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="draft", help="the drafter the page forces (one the server lists)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default="docs/demo.png")
    ap.add_argument("--url", help="a running serve's OpenAI base URL instead of starting one on the bundled pair")
    args = ap.parse_args(argv)

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from serving.demo import app as demo
    from serving.server.launch import free_port

    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    url = args.url or demo.start_local_server(None, ["engine.max_batch_size=1"])[0]
    client, model, drafters = demo.connect(url, None)
    page = demo.build_page(client, model, drafters, args.max_tokens)
    port = free_port()
    page.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, css=demo.CSS, quiet=True)

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=options)
    try:
        driver.get(f"http://127.0.0.1:{port}")
        time.sleep(3)
        box = driver.find_element(By.CSS_SELECTOR, "#prompt textarea")
        box.clear()
        box.send_keys(args.prompt)
        pick = driver.find_element(By.CSS_SELECTOR, "#drafter input")
        pick.click()
        pick.send_keys(Keys.CONTROL, "a")
        pick.send_keys(args.drafter, Keys.ENTER)
        driver.find_element(By.CSS_SELECTOR, "#run").click()
        deadline = time.monotonic() + 600
        while not driver.find_elements(By.CSS_SELECTOR, "#alone .tokens[data-done='true']"):
            if time.monotonic() > deadline:
                raise SystemExit("the page did not finish both runs in 600 s")
            time.sleep(1)
        time.sleep(1)
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(1100, min(max(height + 40, 800), 2400))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(args.out)
        print(driver.find_element(By.CSS_SELECTOR, "#summary").text)
        print(f"wrote {args.out}")
    finally:
        driver.quit()
        page.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
