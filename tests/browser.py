"""A real browser for the tests: headless Chromium driven over the DevTools protocol, and a TensorBoard server.

Standard library only (no selenium, no playwright): Chromium from the OS packages (Debian's ``chromium``) runs
headless with ``--remote-debugging-port``; :class:`Browser` speaks the DevTools protocol over a minimal
WebSocket client. ``make test`` runs ``python tests/browser.py install`` first: it installs Chromium with apt-get
where it is missing and it can (root, apt-get present), and otherwise says why and exits 0, so a machine
without apt still runs the rest of the suite. ``benchmarks/verdict_map.py`` takes the docs' screenshots with it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, List, Optional, Tuple

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
URL_RE = re.compile(r"(http://127\.0\.0\.1:\d+)/")

#: JavaScript: every element matching a selector, inside shadow roots too (TensorBoard's dashboards use them).
DEEP_ALL = """
(function deepAll(sel) {
  const out = [];
  (function walk(root) {
    root.querySelectorAll(sel).forEach(e => out.push(e));
    root.querySelectorAll('*').forEach(e => { if (e.shadowRoot) walk(e.shadowRoot); });
  })(document);
  return out;
})
"""


def find_chromium() -> Optional[str]:
    """The Chromium executable on PATH, or None."""
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def chromium(install: bool = True) -> Tuple[Optional[str], str]:
    """``(path, "")``, or ``(None, why)`` when Chromium is missing and cannot be installed here.

    With ``install``, a missing Chromium is installed with ``apt-get install chromium`` where that can work
    (apt-get on PATH, running as root); ``apt-get update`` first when the package is not known yet.
    """
    path = find_chromium()
    if path or not install:
        return path, "" if path else "chromium is not installed"
    if shutil.which("apt-get") is None:
        return None, "chromium is not installed and there is no apt-get to install it (Debian/Ubuntu: apt-get install chromium)"
    if os.geteuid() != 0:
        return None, "chromium is not installed and installing it with apt-get needs root (sudo apt-get install chromium)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
    log = []
    for step in ([cmd], [["apt-get", "update"], cmd]):
        for c in step:
            done = subprocess.run(c, env=env, capture_output=True, text=True)
            log.append(f"$ {' '.join(c)} -> {done.returncode}\n{done.stderr[-800:]}")
        path = find_chromium()
        if path:
            return path, ""
    return None, "apt-get could not install chromium:\n" + "\n".join(log)


class TensorBoardServer:
    """``python -m tensorboard.main`` on a free port (``--port 0``); :meth:`url` once it has said where it listens.

    Example (not run: it starts a server)::

        server = TensorBoardServer(logdir)
        try:
            base = server.url(time.monotonic() + 60)
        finally:
            server.stop()
    """

    def __init__(self, logdir: Path) -> None:
        self.lines: List[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
             "--port", "0", "--load_fast=false", "--reload_interval", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def url(self, deadline: float) -> str:
        """The server's base URL; raises RuntimeError when it has not said by ``deadline`` (``time.monotonic()``)."""
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = URL_RE.search(line)
                if m:
                    return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError("TensorBoard did not report its URL:\n" + "".join(self.lines))

    def stop(self) -> None:
        """Terminate it (kill after 10 s)."""
        _stop(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def get_json(url: str) -> Any:
    """GET ``url`` and parse its JSON body."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read().decode("utf-8"))


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class _WebSocket:
    """The client side of RFC 6455, as much as the DevTools protocol needs: text frames, masked, any length."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        m = re.match(r"ws://([^/:]+):(\d+)(/.*)", url)
        if m is None:
            raise ValueError(f"not a ws:// URL: {url}")
        host, port, path = m.group(1), int(m.group(2)), m.group(3)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("the browser closed the WebSocket handshake")
            head += chunk
        status = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status:
            raise ConnectionError(f"WebSocket handshake refused: {status.decode(errors='replace')}")
        self.buffer = head.split(b"\r\n\r\n", 1)[1]

    def send(self, text: str) -> None:
        data = text.encode()
        n = len(data)
        header = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
                                  if n < 1 << 16 else bytes([0x80 | 127]) + struct.pack(">Q", n))
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        self.sock.sendall(header + mask + masked)

    def _exact(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the browser closed the WebSocket")
            self.buffer += chunk
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def recv(self) -> str:
        parts = []
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._exact(8))[0]
            payload = self._exact(n)
            if b0 & 0x0F == 0x8:
                raise ConnectionError("the browser closed the WebSocket")
            if b0 & 0x0F in (0x9, 0xA):  # ping, pong: not a message
                continue
            parts.append(payload)
            if b0 & 0x80:
                return b"".join(parts).decode()

    def close(self) -> None:
        self.sock.close()


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol.

    Args:
        executable: Chromium (:func:`chromium`).
        width, height: The page's viewport.

    Example (not run: it starts a browser)::

        with Browser(chromium()[0]) as b:
            b.open("file:///tmp/report.html")
            assert b.evaluate("document.title")
    """

    def __init__(self, executable: str, width: int = 1400, height: int = 1000) -> None:
        self.profile = tempfile.mkdtemp(prefix="gradwatch-chromium-")
        self.proc = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
             "--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._id = 0
        try:
            port = self._port(time.monotonic() + 30)
            pages = [t for t in get_json(f"http://127.0.0.1:{port}/json/list") if t.get("type") == "page"]
            self.ws = _WebSocket(pages[0]["webSocketDebuggerUrl"])
            self.call("Page.enable")
            self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.close()
            raise

    def _port(self, deadline: float) -> int:
        marker = Path(self.profile) / "DevToolsActivePort"
        while time.monotonic() < deadline:
            if marker.is_file():
                lines = marker.read_text().split("\n")
                if lines and lines[0].strip().isdigit():
                    return int(lines[0])
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"chromium exited ({self.proc.returncode}) before it listened:\n{err[-2000:]}")
            time.sleep(0.05)
        raise RuntimeError("chromium did not open its DevTools port in 30 s")

    def call(self, method: str, **params: Any) -> Any:
        """One DevTools command; returns its ``result`` (events met on the way are dropped)."""
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result")

    def open(self, url: str) -> None:
        """Navigate to ``url`` and wait for its load (5 s at most: a single-page app keeps loading after)."""
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", timeout=5, fail=False)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript raised: {result['exceptionDetails'].get('text')} in {expression[:200]}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0, fail: bool = True) -> Any:
        """Poll ``expression`` until it is truthy; returns it (raises TimeoutError, or returns the last value)."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.25)
        if fail:
            raise TimeoutError(f"not true in {timeout:.0f} s: {expression[:300]} (last value {value!r})")
        return value

    def screenshot(self, path: Path, full_page: bool = False) -> None:
        """A PNG of the viewport (or of the whole page)."""
        params: dict = {"format": "png"}
        if full_page:
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
            params["captureBeyondViewport"] = True
        Path(path).write_bytes(base64.b64decode(self.call("Page.captureScreenshot", **params)["data"]))

    def close(self) -> None:
        """Stop the browser and remove its profile."""
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        _stop(self.proc)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


if __name__ == "__main__":  # `python tests/browser.py install`, from `make test`
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python tests/browser.py install")
    found, why = chromium(install=True)
    print(f"browser tests: chromium at {found}" if found else f"browser tests: no chromium: {why}; they will be skipped")
