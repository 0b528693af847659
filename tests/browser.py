"""A real headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe).

The pipe needs no WebSocket client and no port: commands go to the browser's fd 3, replies come back on
its fd 4, each message JSON ended by a NUL byte. Used to open a page, read what rendered, list every
request it made, and screenshot it.
"""

from __future__ import annotations

import base64
import json
import os
import selectors
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from infra import in_ci

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def chromium() -> str:
    """The chromium binary; its absence fails in CI and skips elsewhere."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if in_ci():
            pytest.fail("chromium is required in CI (apt-get install chromium)")
        pytest.skip("no chromium here for the real-browser check")
    return found


@dataclass
class Page:
    text: str  # document.body.innerText
    images: list[tuple[bool, int]]  # (complete, naturalWidth) of every <img>
    requests: list[str]  # the URL of every request the page made, itself included


class _Pipe:
    def __init__(self, proc: subprocess.Popen, to_browser: int, from_browser: int, deadline: float) -> None:
        self.proc, self.out, self.inp, self.deadline = proc, to_browser, from_browser, deadline
        self.buf = b""
        self.events: list[dict[str, Any]] = []
        self.next_id = 0
        self.sel = selectors.DefaultSelector()
        self.sel.register(from_browser, selectors.EVENT_READ)

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self.buf:
            left = self.deadline - time.monotonic()
            if left <= 0 or not self.sel.select(left):
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self.inp, 1 << 16)
            if not chunk:
                raise EOFError(f"chromium closed the pipe (exit {self.proc.poll()})")
            self.buf += chunk
        message, self.buf = self.buf.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.out, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str) -> dict[str, Any]:
        for event in self.events:
            if event.get("method") == method:
                return event
        while True:
            event = self._read()
            self.events.append(event)
            if event.get("method") == method:
                return event


def open_page(url: str, screenshot: Path, profile: Path, timeout_s: float = 120) -> Page:
    """Load URL in a fresh headless Chromium, wait for its load event, screenshot the whole page."""
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()

    def child() -> None:  # the browser reads fd 3 and writes fd 4
        import fcntl

        a, b = fcntl.fcntl(to_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_w, fcntl.F_DUPFD, 10)
        os.dup2(a, 3)
        os.dup2(b, 4)

    proc = subprocess.Popen(
        [chromium(), *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe", "--window-size=1200,900",
         "about:blank"],
        pass_fds=tuple({to_r, from_w, 3, 4}), preexec_fn=child, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    os.close(to_r)
    os.close(from_w)
    pipe = _Pipe(proc, to_w, from_r, time.monotonic() + timeout_s)
    try:
        target = pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        pipe.send("Network.enable", session=session)
        pipe.send("Page.enable", session=session)
        pipe.send("Page.navigate", {"url": url}, session=session)
        pipe.wait_event("Page.loadEventFired")
        probe = ("JSON.stringify({text: document.body.innerText, "
                 "images: Array.from(document.images).map(i => [i.complete, i.naturalWidth])})")
        found = json.loads(pipe.send("Runtime.evaluate", {"expression": probe, "returnByValue": True},
                                     session=session)["result"]["value"])
        shot = pipe.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=session)
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        requests = [e["params"]["request"]["url"] for e in pipe.events if e.get("method") == "Network.requestWillBeSent"]
        return Page(found["text"], [tuple(i) for i in found["images"]], requests)
    finally:
        try:
            os.write(to_w, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
        except OSError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        os.close(to_w)
        os.close(from_r)
