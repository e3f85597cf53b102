"""The live status page, rendered by a real browser (headless Chromium, driven over the DevTools
protocol) against the real stack while it parks requests: what an operator sees, not the JSON.

Outside CI a missing `chromium` skips this with the reason (Debian: apt-get install chromium;
scripts/install-system-deps.sh installs it); under CI=true it fails, so a broken CI image cannot
pass by skipping.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devstack import http_get, wait_until
from extproc.adminhttp import STATIC_FILES

from .conftest import Stack
from .http import chat_body, post

URL = "/v1/chat/completions"
STATIC = Path(__file__).resolve().parents[2] / "extproc" / "static"


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    message = ("chromium not found on PATH "
               "(Debian: apt-get install chromium; scripts/install-system-deps.sh installs it)")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and {message}")
    pytest.skip(message)


class Browser:
    """One headless Chromium page, driven over the DevTools protocol (a WebSocket)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self.ids)
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json(timeout=30)
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, what: str, timeout: float = 20.0) -> Any:
        """Poll a JavaScript expression until it is truthy (the page redraws once a second)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        value = None
        while loop.time() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(0.1)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}; last value {value!r}")


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator[int]:
    """A headless Chromium with its DevTools endpoint on a free port; yields the port."""
    binary = _chromium()
    profile = tmp_path / "chromium-profile"
    log = open(tmp_path / "chromium.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(
        [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}",
         "--window-size=1280,1800", "about:blank"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        port_file = profile / "DevToolsActivePort"
        wait_until(lambda: port_file.exists() and port_file.read_text().strip(), 30, "Chromium's DevTools port")
        yield int(port_file.read_text().split()[0])
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


async def _page(port: int) -> tuple[aiohttp.ClientSession, Browser]:
    session = aiohttp.ClientSession()
    async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
        targets = await response.json()
    (page,) = [t for t in targets if t["type"] == "page"]
    ws = await session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
    return session, Browser(ws)


ENGINE = '[data-engine="default"]'
STATE_JS = f"""JSON.stringify((() => {{
  const e = document.querySelector('{ENGINE}');
  if (!e) return null;
  const field = (f) => e.querySelector(`[data-field="${{f}}"]`).textContent;
  const rows = (t) => [...e.querySelectorAll(`[data-table="${{t}}"] tbody tr[data-row]`)]
    .map((tr) => [...tr.children].map((td) => td.textContent));
  const points = (c) => [...e.querySelectorAll(`[data-chart="${{c}}"] polyline`)]
    .map((p) => p.getAttribute("points").split(" ").filter(Boolean).length);
  return {{
    state: field("state"), gate: field("gate"), running: field("running"), waiting: field("waiting"),
    kv: field("kv_usage"), age: field("snapshot_age"), queue_depth: field("queue_depth"),
    capacity: field("capacity_tokens"), queue: rows("queue"), recent: rows("recent"),
    charts: {{load: points("load"), kv: points("kv"), queue: points("queue"), decisions: points("decisions")}},
    freshness: document.getElementById("freshness").textContent, marker: window.__notReloaded === true,
    url: field("url"), banner: e.querySelector('[data-field="banner"]').hidden ? null : field("banner"),
    age_sub: field("snapshot_age-sub"),
    alerts: document.getElementById("alerts").hidden ? null : document.getElementById("alerts").textContent,
    x_axis: [...e.querySelectorAll('[data-chart="kv"]')].map((c) => [...c.closest(".chart")
      .querySelectorAll('[data-axis="x"] span')].map((s) => s.textContent))[0],
    y_axis: Object.fromEntries(["load", "kv", "queue", "decisions"].map((c) => [c, [...e.querySelector(
      `[data-chart="${{c}}"]`).closest(".chart").querySelectorAll('[data-axis="y"] span')].map((s) => s.textContent)])),
  }};
}})())"""


async def _state(browser: Browser) -> dict[str, Any]:
    return json.loads(await browser.evaluate(STATE_JS) or "null")


def test_the_page_shows_requests_parking_and_leaving_live(stack: Stack, chromium: int, tmp_path: Path) -> None:
    stack.pin(running=4, waiting=1)
    stack.wait_gate(False)
    with ThreadPoolExecutor(2) as pool:
        parked = [pool.submit(post, stack.url + URL, chat_body("x" * 4000, max_tokens=100), {"x-request-id": f"p{i}"})
                  for i in range(2)]
        stack.wait_state(lambda s: s["queue_depth"] == 2, "two requests to park")

        async def drive() -> tuple[dict[str, Any], dict[str, Any], bytes, list[str]]:
            session, browser = await _page(chromium)
            try:
                await browser.send("Network.enable")
                await browser.send("Page.enable")
                await browser.send("Page.navigate", url=f"{stack.local.admin_url}/")
                await browser.wait_for(
                    f"document.querySelectorAll('{ENGINE} [data-table=\"queue\"] tr[data-row]').length === 2",
                    "the two parked requests on the page")
                # Charts need two history samples (one a second) to draw a line.
                await browser.wait_for(
                    f"document.querySelector('{ENGINE} [data-chart=\"queue\"] polyline').getAttribute('points')"
                    ".split(' ').filter(Boolean).length >= 2", "the queue chart")
                await browser.evaluate("window.__notReloaded = true")
                parked_view = await _state(browser)
                shot = await browser.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
                # Room at the engine: the parked requests are admitted, and the page follows without a reload.
                stack.sim("/control/unpin", {})
                await browser.wait_for(
                    f"document.querySelectorAll('{ENGINE} [data-table=\"queue\"] tr[data-row]').length === 0 && "
                    f"document.querySelector('{ENGINE} [data-table=\"recent\"] tbody').textContent"
                    ".includes('admitted_after_park')", "the queue to empty on the page")
                released_view = await _state(browser)
                urls = [e["params"]["request"]["url"] for e in browser.events
                        if e.get("method") == "Network.requestWillBeSent"]
                return parked_view, released_view, __import__("base64").b64decode(shot["data"]), urls
            finally:
                await browser.ws.close()
                await session.close()

        parked_view, released_view, png, urls = asyncio.run(drive())
        assert all(f.result(timeout=30).status == 200 for f in parked)

    (tmp_path / "status-page.png").write_bytes(png)
    if os.environ.get("STATUS_PAGE_SCREENSHOT"):
        Path(os.environ["STATUS_PAGE_SCREENSHOT"]).write_bytes(png)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000

    # While parked: the engine's pinned gauges, the closed gate, both requests with their age and size.
    v = parked_view
    assert v["state"] == "engine state fresh" and v["gate"] == "gate closed"
    assert (v["running"], v["waiting"]) == ("4", "1")
    assert v["kv"].endswith("%") and v["age"].endswith("s")
    assert v["queue_depth"] == "2" and v["capacity"] == "8,192"
    assert [row[0] for row in v["queue"]] == ["1", "2"]
    for _position, model, waiting_for, tokens, cost, cap_in in v["queue"]:
        assert model == "sim-model" and waiting_for.endswith("s") and cap_in.endswith("s")
        assert int(tokens.replace(",", "")) > 1000  # 4,000 bytes of prompt + 100 generation, estimated
        assert int(cost.replace(",", "")) % 16 == 0  # rounded up to whole KV blocks
    assert [row[2] for row in v["recent"][:2]] == ["parked", "parked"]
    assert v["recent"][0][3] == "no room: waiting in the park"
    assert all(n >= 2 for n in (v["charts"]["load"][0], v["charts"]["kv"][0], v["charts"]["queue"][0]))
    assert v["freshness"].startswith("live")
    # The engine's address, no alarm while its metrics are read, and charts with a time axis and a scale.
    assert v["url"] == f"engine {stack.local.engine_base}, metrics {stack.local.engine_base}/metrics"
    assert v["banner"] is None and v["alerts"] is None
    assert v["x_axis"] == ["5 min ago", "4 min ago", "3 min ago", "2 min ago", "1 min ago", "now"]
    assert v["y_axis"]["kv"] == ["100.0 %", "50.0 %", "0.0 %"]
    assert v["y_axis"]["queue"][-1] == "0" and float(v["y_axis"]["queue"][0]) >= 2  # two parked, on the scale
    assert v["y_axis"]["decisions"][-1] == "0.00/s" and v["y_axis"]["decisions"][0].endswith("/s")
    # No prompt content anywhere on the page.
    assert "xxxx" not in json.dumps(v)

    # After release, in the same page (no reload).
    r = released_view
    assert r["marker"] is True
    assert r["queue"] == [] and r["gate"] == "gate open"
    assert [row[2] for row in r["recent"]].count("admitted_after_park") == 2
    # Everything came from the admin port: no CDN, nothing external.
    assert urls and all(u.startswith(stack.local.admin_url) for u in urls), urls


def test_status_json_and_static_files(stack: Stack) -> None:
    status, body = http_get(f"{stack.local.admin_url}/debug/status")
    assert status == 200
    doc = json.loads(body)
    (engine,) = doc["engines"]
    assert engine["name"] == "default" and engine["state"] == "fresh" and engine["queue"] == []
    assert {"history", "recent", "limits", "snapshot", "available_tokens", "reserved_tokens"} <= set(engine)
    for name in STATIC_FILES:
        status, served = http_get(f"{stack.local.admin_url}/static/{name}")
        assert status == 200 and served == (STATIC / name).read_bytes()
        assert b"http://" not in served.replace(b"http://www.w3.org/2000/svg", b"") and b"https://" not in served
    assert http_get(f"{stack.local.admin_url}/static/..%2Fadmission.py")[0] == 404
    assert http_get(f"{stack.local.admin_url}/static/nothing.js")[0] == 404
    status, page = http_get(f"{stack.local.admin_url}/")
    assert status == 200 and b"/static/status.js" in page


def test_the_status_page_is_not_on_the_probe_port(make_stack: Callable[..., Stack]) -> None:
    from devstack import free_port

    probe = free_port()
    stack = make_stack({"EXTPROC_PROBE_LISTEN": f"127.0.0.1:{probe}"})
    for path in ("/", "/debug/status", "/static/status.js"):
        assert http_get(f"http://127.0.0.1:{probe}{path}")[0] == 404
        assert http_get(f"{stack.local.admin_url}{path}")[0] == 200


# --- an engine whose metrics cannot be read: one test per state, asserted on the rendered page ---

def _page_when(chromium: int, admin_url: str, condition: str, what: str) -> dict[str, Any]:
    """Open the status page, wait until the JavaScript `condition` holds for the engine's section
    (`e`), and return what it shows."""
    async def drive() -> dict[str, Any]:
        session, browser = await _page(chromium)
        try:
            await browser.send("Page.enable")
            await browser.send("Page.navigate", url=f"{admin_url}/")
            await browser.wait_for(f"(() => {{ const e = document.querySelector('{ENGINE}'); "
                                   f"return !!e && ({condition}); }})()", what, timeout=30)
            return await _state(browser)
        finally:
            await browser.ws.close()
            await session.close()

    return asyncio.run(drive())


BANNER = "e.querySelector('[data-field=\"banner\"]')"


def _never_open(view: dict[str, Any]) -> None:
    """The page's promise for an engine it cannot read: no open gate, admission said to be off."""
    assert view["gate"] == "admission OFF: failing open", view
    assert "gate open" not in json.dumps(view)
    assert view["alerts"] is not None and view["alerts"].startswith("default: ") and view["banner"] in view["alerts"]


def test_an_engine_nobody_listens_on_is_shown_unreachable_never_read(
        make_stack: Callable[..., Stack], chromium: int) -> None:
    from devstack import free_port

    engine = f"http://127.0.0.1:{free_port()}"
    stack = make_stack(engine_url=engine)
    view = _page_when(chromium, stack.local.admin_url, f"{BANNER}.textContent.includes('UNREACHABLE')",
                      "the unreachable banner")
    assert view["banner"].startswith("UNREACHABLE: never read, ") and "(engine unreachable: " in view["banner"]
    assert view["banner"].endswith("admission OFF: failing open")
    _never_open(view)
    assert view["url"] == f"engine {engine}, metrics {engine}/metrics"
    assert view["age"] == "never read" and view["age_sub"].startswith("unreachable: ")
    assert (view["running"], view["kv"]) == ("–", "–")


def test_an_engine_gone_after_a_good_poll_is_shown_stale_with_the_age_of_that_poll(
        stack: Stack, chromium: int) -> None:
    stack.wait_state(lambda s: s["state"] == "fresh", "a good poll")
    assert stack.local.sim is not None
    stack.local.sim.stop()
    view = _page_when(chromium, stack.local.admin_url, f"{BANNER}.textContent.startsWith('STALE')",
                      "the stale banner")
    banner = view["banner"]
    assert "polls failed in a row (engine unreachable: " in banner and ", stale after 3; last good poll " in banner
    assert banner.endswith(" s ago; admission OFF: failing open")
    _never_open(view)
    assert view["age"].endswith(" s") and view["age_sub"].startswith("stale: ") and "(unreachable)" in view["age_sub"]
    assert view["running"] != "–"  # the last good gauges stay visible, marked as such


def test_garbage_metrics_are_shown_degraded(stack: Stack, chromium: int) -> None:
    stack.wait_state(lambda s: s["state"] == "fresh", "a good poll")
    stack.sim("/control/metrics_mode", {"mode": "garbage"})
    view = _page_when(chromium, stack.local.admin_url,
                      f"{BANNER}.textContent.startsWith('DEGRADED') && {BANNER}.textContent.includes('failing open')",
                      "the degraded banner")
    assert "(engine metrics unparsable (observer degraded): " in view["banner"]
    assert "last good poll " in view["banner"]
    _never_open(view)
    assert view["age_sub"].startswith("degraded: ") and "(unparsable)" in view["age_sub"]
