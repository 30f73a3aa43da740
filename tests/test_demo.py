"""The web demo (serving/demo) in a real browser: headless Chromium driven by Selenium through the
page, against a live server on tiny models. Skipped, saying why, where Chromium, its driver, Gradio
or Selenium is absent (``.ci/run`` installs Debian's ``chromium`` and ``chromium-driver``)."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from serving.demo import app as demo

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
PROMPT = "Say something long."
MAX_TOKENS = 24


def _missing() -> str | None:
    for module in ("gradio", "selenium"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install -e '.[dev]')"
    if CHROMIUM is None or CHROMEDRIVER is None:
        return "no chromium / chromedriver on PATH (Debian: apt-get install chromium chromium-driver; .ci/run does)"
    return None


pytestmark = [pytest.mark.e2e, pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]


@pytest.fixture(scope="module")
def served(model_dirs, tmp_path_factory):
    """serve on the tiny pair, with a router whose ``code`` draft is the target itself: every draft
    token it proposes is accepted, so the page must show accepted draft tokens."""
    from routing.router import Router
    from tests.test_server import LiveServer

    router = tmp_path_factory.mktemp("demo-router") / "router.pt"
    Router.create({"code": str(model_dirs["target"])}, str(model_dirs["target"])).save(router)
    srv = LiveServer([f"router={router}", "engine.max_len=128", "engine.max_batch_size=2", "engine.k=4"])
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def page_url(served):
    from serving.server.launch import free_port

    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    client, model, drafters = demo.connect(f"{served.url}/v1", None, timeout_s=30)
    assert "code" in drafters and "none" not in drafters
    page = demo.build_page(client, model, drafters, max_tokens=MAX_TOKENS)
    port = free_port()
    page.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, css=demo.CSS, quiet=True)
    yield f"http://127.0.0.1:{port}"
    page.close()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = predicate()
        except Exception:  # the element is not there yet
            got = None
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_the_page_streams_the_apis_greedy_answer_with_accepted_tokens_marked(served, page_url, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser.get(page_url)
    box = _wait(lambda: browser.find_element(By.CSS_SELECTOR, "#prompt textarea"), 60, "the prompt box")
    box.clear()
    box.send_keys(PROMPT)
    pick = browser.find_element(By.CSS_SELECTOR, "#drafter input")
    pick.click()
    pick.send_keys(Keys.CONTROL, "a")
    pick.send_keys("code")
    pick.send_keys(Keys.ENTER)
    _wait(lambda: browser.find_element(By.CSS_SELECTOR, "#drafter input").get_attribute("value") == "code", 10,
          "the drafter to read 'code'")  # fmt: skip
    browser.find_element(By.CSS_SELECTOR, "#run").click()
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#alone .tokens[data-done='true']"), 120,
          "both runs to finish")  # fmt: skip
    shown = browser.execute_script("return document.querySelector('#answer .tokens').textContent")
    alone = browser.execute_script("return document.querySelector('#alone .tokens').textContent")

    expected = served.client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": PROMPT}],
                                                     max_tokens=MAX_TOKENS, temperature=0, extra_body={"draft": "code"})  # fmt: skip
    assert shown == expected.choices[0].message.content and shown
    assert alone == shown  # the target alone says the same: the output is the target's own
    drafted = browser.find_elements(By.CSS_SELECTOR, "#answer .tok.draft[data-drafter='code']")
    assert drafted, "no accepted draft token is marked"
    assert not browser.find_elements(By.CSS_SELECTOR, "#alone .tok.draft")  # the target alone drafts nothing
    summary = browser.find_element(By.CSS_SELECTOR, "#summary").text
    assert "speedup" in summary and "code (forced)" in summary
    browser.save_screenshot(str(tmp_path / "demo.png"))


def test_the_screenshot_script_captures_the_finished_page(served, tmp_path, capsys):
    from tests.conftest import load_script

    shot = load_script("scripts/experiments/demo_screenshot.py")
    out = tmp_path / "demo.png"
    assert shot.main(["--url", f"{served.url}/v1", "--drafter", "code", "--max-tokens", "8", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "speedup" in capsys.readouterr().out


def test_the_grammars_forced_tokens_get_their_own_colour(served):
    """A JSON-schema answer with the ``grammar`` drafter: its accepted drafts are the grammar's
    forced tokens, marked ``grammar`` (their own colour in the legend), and the text is the target
    alone's under the same schema."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
              "required": ["answer", "ok"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    *_, run = demo.stream(served.client, served.model, PROMPT, "grammar", 48, fmt)
    *_, alone = demo.stream(served.client, served.model, PROMPT, "none", 48, fmt)
    assert run.done and run.text == alone.text and run.text.startswith('{"answer":')
    html = demo.render_tokens(run)
    assert html.count("class='tok grammar'") >= 3 and "tok grammar" not in demo.render_tokens(alone)
    assert ".tok.grammar" in demo.CSS and "forced token" in demo.legend()
