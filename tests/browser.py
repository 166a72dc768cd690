"""Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
JSON messages ending in NUL on fds 3 and 4, no websocket library and no port).

:func:`load_page` opens a local file, waits for its load event, and returns every request the page
made, every console message and uncaught exception, the ids of the page's elements, and a PNG
screenshot. The browser is Debian's ``chromium`` (``.ci/run`` installs it); :func:`find_chromium`
says where it is, or None.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    env = os.environ.get("OPTFUSE_CHROMIUM")
    if env:
        return env if shutil.which(env) else None
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


@dataclass
class PageRun:
    requests: list[str] = field(default_factory=list)  # every URL the page asked for, the document first
    console: list[tuple[str, str]] = field(default_factory=list)  # (level, text) of console and log entries
    exceptions: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)  # the id of every element
    screenshot: bytes = b""

    @property
    def errors(self) -> list[str]:
        return [t for lvl, t in self.console if lvl == "error"] + self.exceptions


class _Pipe:
    def __init__(self, write_fd: int, read_fd: int):
        self.w, self.r = os.fdopen(write_fd, "wb", buffering=0), os.fdopen(read_fd, "rb", buffering=0)
        self.buf, self.next_id, self.events = b"", 0, []

    def send(self, method: str, session: str | None = None, **params) -> int:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        self.w.write(json.dumps(msg).encode() + b"\0")
        return self.next_id

    def _read(self) -> dict:
        while b"\0" not in self.buf:
            chunk = self.r.read(1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self.buf += chunk
        raw, self.buf = self.buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, session: str | None = None, **params) -> dict:
        want = self.send(method, session, **params)
        while True:
            msg = self._read()
            if msg.get("id") == want:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_for(self, method: str, deadline: float) -> None:
        if any(e.get("method") == method for e in self.events):
            return
        while time.monotonic() < deadline:
            msg = self._read()
            self.events.append(msg)
            if msg.get("method") == method:
                return
        raise TimeoutError(f"no {method} from chromium")


def load_page(chromium: str, page: Path, width: int = 1200, timeout: float = 60.0) -> PageRun:
    """Open `page` in headless `chromium`; see the module doc for what comes back."""
    profile = tempfile.mkdtemp(prefix="optfuse-chromium-")
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()
    # the browser reads commands on fd 3 and writes replies on fd 4; the pipe ends move to fds >= 10 first,
    # so that neither dup2 overwrites the other's source. Python's own fds are not inheritable (PEP 446):
    # with close_fds=False the browser gets 0-4 and nothing else.
    commands, replies = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_browser_r, from_browser_w))
    os.close(to_browser_r)
    os.close(from_browser_w)

    def child_fds():
        os.dup2(commands, 3)
        os.dup2(replies, 4)

    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
           "--disable-extensions", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--metrics-recording-only", "--remote-debugging-pipe", f"--user-data-dir={profile}",
           "about:blank"]
    proc = subprocess.Popen(cmd, preexec_fn=child_fds, close_fds=False, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    os.close(commands)
    os.close(replies)
    pipe = _Pipe(to_browser_w, from_browser_r)
    try:
        return _drive(pipe, page, width, time.monotonic() + timeout)
    finally:
        try:
            pipe.send("Browser.close")
        except OSError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


def _drive(pipe: _Pipe, page: Path, width: int, deadline: float) -> PageRun:
    target = pipe.call("Target.createTarget", url="about:blank")["targetId"]
    session = pipe.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
    for domain in ("Page", "Network", "Runtime", "Log"):
        pipe.call(f"{domain}.enable", session)
    pipe.call("Emulation.setDeviceMetricsOverride", session, width=width, height=900, deviceScaleFactor=1,
              mobile=False)
    pipe.events.clear()  # what about:blank did is not the page's
    pipe.call("Page.navigate", session, url=page.resolve().as_uri())
    pipe.wait_for("Page.loadEventFired", deadline)
    ids = pipe.call("Runtime.evaluate", session, returnByValue=True,
                    expression="Array.from(document.querySelectorAll('[id]'), e => e.id)")["result"]["value"]
    shot = pipe.call("Page.captureScreenshot", session, format="png", captureBeyondViewport=True)["data"]
    run = PageRun(ids=list(ids), screenshot=base64.b64decode(shot))
    for e in pipe.events:
        method, params = e.get("method"), e.get("params", {})
        if method == "Network.requestWillBeSent":
            run.requests.append(params["request"]["url"])
        elif method == "Runtime.consoleAPICalled":
            run.console.append((params["type"], " ".join(str(a.get("value", a.get("description", "")))
                                                         for a in params.get("args", []))))
        elif method == "Log.entryAdded":
            run.console.append((params["entry"]["level"], params["entry"]["text"]))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            run.exceptions.append((details.get("exception") or {}).get("description") or details.get("text", "exception"))
    return run
