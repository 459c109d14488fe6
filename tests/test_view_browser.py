"""The view's page in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`),
driven by selenium. On a recording, what the page draws after each step it is stepped to, forward
and back, is the replay's state at that step (the block grid's counts by state, the queues and
their preempted marks); the timeline marks the preemptions and says each step's numbers on a
hover; a cached-free block's tooltip says whose tokens it keeps; at 1280x900 the timeline is
above the fold. Live, the page follows a nanoinfer server through `python -m view --live`. The
README's screenshot is made here, of the demonstration. Where no Chromium can be had these skip
and say why, unless NANOINFER_REQUIRE_BROWSER=1 (CI sets it): then they fail."""
import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from conftest import random_prompts
from nanoinfer import LLM, SamplingParams
from test_server import start_server, stop_server
from view import demo, server
from view.recording import Recording
from view.replay import Replay

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,900"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    why = None
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        why = "selenium is not installed"
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if why is None and not (binary and driver):
        why = "Debian's chromium and chromium-driver are not installed"
    if why is not None:
        if os.environ.get("NANOINFER_REQUIRE_BROWSER") == "1":
            pytest.fail(f"the browser tests must run here: {why}")
        pytest.skip(why)
    options = Options()
    for flag in FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    options.binary_location = binary
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    yield chrome
    chrome.quit()


def wait_for(condition, seconds: float = 30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (value := condition()):
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def shown_step(browser) -> int | None:
    step = browser.execute_script("return document.body.dataset.step")
    return None if step is None else int(step)


def go(browser, step: int) -> None:
    browser.execute_script("const i = document.getElementById('step-input'); "
                           f"i.value = {step}; i.onchange();")
    wait_for(lambda: shown_step(browser) == step)


def drawn(browser) -> dict:
    text = browser.execute_script
    return {"counts": {k: int(text(f"return document.getElementById('count-{k}').textContent"))
                       for k in ("free", "used", "shared", "cached")},
            "running": [int(x) for x in text("return [...document.querySelectorAll("
                                             "'#running .seq')].map(e => e.dataset.seq)")],
            "waiting": [int(x) for x in text("return [...document.querySelectorAll("
                                             "'#waiting .seq')].map(e => e.dataset.seq)")],
            "preempted": sorted(int(x) for x in text(
                "return [...document.querySelectorAll('.seq.preempted')].map(e => e.dataset.seq)"))}


def expected(records: list, step: int, num_blocks: int) -> dict:
    replay = Replay()
    for record in records:
        if record["t"] == "step" and replay.step == step:
            break
        replay.apply(record)
    refs = replay.ref_counts().values()
    used, shared = sum(n == 1 for n in refs), sum(n > 1 for n in refs)
    return {"counts": {"free": num_blocks - used - shared - len(replay.cached), "used": used,
                       "shared": shared, "cached": len(replay.cached)},
            "running": replay.running, "waiting": replay.waiting,
            "preempted": sorted(s for s, q in replay.seqs.items() if q.preempted)}


@pytest.fixture(scope="module")
def recorded(llama_dir, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("page") / "run.jsonl")
    llm = LLM(llama_dir, event_log=path, num_kvcache_blocks=12, max_num_batched_tokens=40,
              max_num_seqs=5, max_model_len=192)
    shared = random_prompts([33], seed=1)[0]
    llm.generate(random_prompts([10, 50, 20, 5, 30, 12], seed=2, prefix=shared),
                 SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return path


def test_the_page_draws_the_replays_state_stepping_forward_and_back(browser, recorded):
    import json
    from selenium.webdriver.common.action_chains import ActionChains
    records = [json.loads(line) for line in open(recorded)]
    recording = Recording.read(recorded)
    http = server.serve(recording, 0, block=False)
    try:
        browser.get(f"http://127.0.0.1:{http.server_address[1]}/")
        wait_for(lambda: shown_step(browser) == 0)
        last = recording.info()["last"]
        preempting = next(r for r in recording.timeline(0) if r[6])[0]
        for step in [1, 2, 3, preempting, preempting + 1, last, last - 1, preempting - 1, 5, 0]:
            go(browser, step)
            assert drawn(browser) == expected(records, step, 12), step
        browser.find_element("id", "forward").click()
        wait_for(lambda: shown_step(browser) == 1)
        browser.find_element("id", "back").click()
        wait_for(lambda: shown_step(browser) == 0)
        assert browser.find_elements("css selector", ".marker-preempt")
        assert browser.find_elements("css selector", ".marker-hit")
        timeline = browser.find_element("id", "timeline-svg")
        assert timeline.rect["y"] + timeline.rect["height"] < 900   # (above the fold)
        bar = browser.find_element("css selector", f".hover[data-row='{preempting}']")
        ActionChains(browser).move_to_element(bar).perform()
        tip = wait_for(lambda: browser.find_element("id", "tooltip").text)
        assert f"step {preempting} · prefill" in tip and "preempted" in tip
        cached_step = next(s for s in range(last, -1, -1)
                           if expected(records, s, 12)["counts"]["cached"])
        go(browser, cached_step)
        state = recording.state(cached_step)
        block = int(next(iter(state["cached"])))
        cell = browser.execute_script("return cells")["size"]
        per_row = browser.execute_script("return cells")["perRow"]
        canvas = browser.find_element("id", "grid-canvas")
        x = (block % per_row) * cell + cell // 2 - canvas.rect["width"] / 2
        y = (block // per_row) * cell + cell // 2 - canvas.rect["height"] / 2
        ActionChains(browser).move_to_element_with_offset(canvas, x, y).perform()
        tip = wait_for(lambda: "cached-free" in (t := browser.find_element("id", "tooltip").text)
                       and t)
        assert f"block {block}: cached-free" in tip and "the tokens" in tip and "sequence" in tip
        assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        http.shutdown()


def test_the_live_page_follows_a_server(browser, llama_dir):
    proc, url = start_server(llama_dir, "--api-key", "k", "--max-num-batched-tokens", "64",
                             "--num-kvcache-blocks", "40")
    port = server_port()
    view = subprocess.Popen([sys.executable, "-m", "view", "--live", url, "--api-key", "k",
                             "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert "view: http://127.0.0.1" in view.stdout.readline()
        page = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(page + "/api/info").json()["header"] is not None)
        browser.get(page + "/")
        body = {"prompt": [5, 6, 7] * 20, "max_tokens": 30, "n": 3, "ignore_eos": True}
        answer = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer k"},
                            timeout=120)
        assert answer.status_code == 200
        last = wait_for(lambda: (info := httpx.get(page + "/api/info").json())["last"] > 25
                        and info["last"])
        wait_for(lambda: shown_step(browser) == last)   # (it follows the engine)
        state = httpx.get(page + f"/api/state?step={last}").json()
        shown = drawn(browser)
        assert shown["running"] == state["running"] and shown["waiting"] == state["waiting"]
        assert "(live)" in browser.find_element("id", "where").text
    finally:
        view.kill()
        view.wait()
        stop_server(proc)


def server_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readmes_screenshot_of_the_demonstration(browser, tmp_path):
    path = str(tmp_path / "demo.jsonl")
    demo.record(path)
    recording = Recording.read(path)
    counts = recording.replay.counts
    assert counts["preemptions"] > 0 and counts["hits"] > 0 and counts["evictions"] > 0
    rows = recording.timeline(0)
    assert any(r[1] == 160 for r in rows)   # (the document's prefill, in chunks of the budget)
    http = server.serve(recording, 0, block=False)
    try:
        browser.get(f"http://127.0.0.1:{http.server_address[1]}/")
        wait_for(lambda: shown_step(browser) == 0)
        go(browser, next(r[0] for r in rows if r[6]))   # (a step that preempted)
        browser.save_screenshot(os.path.join(ROOT, "docs", "view.png"))
    finally:
        http.shutdown()
