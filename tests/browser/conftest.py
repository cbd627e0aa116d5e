"""Browser fixtures: one explorer server and one headless Chromium for the whole session.

The server is uvicorn in a thread on a free port of 127.0.0.1; the browser is
Debian's Chromium (``/usr/bin/chromium``) driven by Playwright. Without that
browser the tests fail with a clear message, unless ``FLASHLEDGER_SKIP_BROWSER=1``
asks to skip them. Every page records its console errors and every request
URL; leaving 127.0.0.1 fails the test.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).parent / "artifacts"
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
]


def _require_browser() -> None:
    if os.environ.get("FLASHLEDGER_SKIP_BROWSER") == "1":
        pytest.skip("FLASHLEDGER_SKIP_BROWSER=1: browser tests skipped on request")
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} not found: install Debian's chromium (`make browser-deps` or "
            "`apt-get install chromium`), or set FLASHLEDGER_SKIP_BROWSER=1 to skip these tests",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """Base URL of an explorer served by uvicorn in a thread, stopped at the end."""
    _require_browser()
    import uvicorn

    from flashledger.web.app import create_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="explorer", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("the explorer server did not start within 30 s", pytrace=False)
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Headless Debian Chromium, shared by every browser test."""
    _require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=LAUNCH_ARGS
        )
        yield chromium
        chromium.close()


@dataclass
class Visit:
    """A page plus what it did: console errors, uncaught errors, every request URL."""

    page: Any
    base: str
    console_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def open(self, query: str = "") -> Any:
        """Load the explorer with ``query`` and wait until every section has been set up."""
        self.page.goto(f"{self.base}/{query}")
        self.page.wait_for_selector("body[data-ready='1']")
        return self.page

    def outside_requests(self) -> list[str]:
        return [url for url in self.requests if not url.startswith(f"{self.base}/")]

    def shot(self, name: str) -> None:
        """Save a full-page screenshot to tests/browser/artifacts/<name>.png (from the top)."""
        ARTIFACTS.mkdir(exist_ok=True)
        self.page.evaluate("window.scrollTo(0, 0)")
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _new_visit(browser: Any, base: str, width: int, height: int, **options: Any) -> Visit:
    context = browser.new_context(viewport={"width": width, "height": height}, **options)
    page = context.new_page()
    v = Visit(page=page, base=base)
    page.on(
        "console", lambda msg: v.console_errors.append(msg.text) if msg.type == "error" else None
    )
    page.on("pageerror", lambda err: v.console_errors.append(f"uncaught: {err}"))
    page.on("request", lambda req: v.requests.append(req.url))
    return v


@pytest.fixture
def visit(browser: Any, server_url: str) -> Iterator[Visit]:
    """A fresh 1280 x 900 page on the explorer; fails if anything left 127.0.0.1."""
    v = _new_visit(browser, server_url, 1280, 900)
    yield v
    v.page.context.close()
    outside = v.outside_requests()
    assert not outside, f"requests left 127.0.0.1: {outside}"


@pytest.fixture
def visit_at(browser: Any, server_url: str) -> Iterator[Any]:
    """A factory of fresh pages: ``visit_at(width, height, **context_options)`` -> Visit.

    Context options go to Playwright's ``new_context`` (``reduced_motion="reduce"``,
    ``has_touch=True``, ...). Every page is closed at the end of the test and fails
    the test if it requested anything outside 127.0.0.1.
    """
    made: list[Visit] = []

    def make(width: int, height: int, **options: Any) -> Visit:
        v = _new_visit(browser, server_url, width, height, **options)
        made.append(v)
        return v

    yield make
    for v in made:
        v.page.context.close()
    outside = [url for v in made for url in v.outside_requests()]
    assert not outside, f"requests left 127.0.0.1: {outside}"
