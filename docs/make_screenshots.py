"""Dashboard screenshots while worker groups are busy: docs/dashboard.png, docs/dask_status.png.

Starts a ``DaskBackend()`` (its own loopback cluster), runs the GRPO demo on it from a
thread, and has headless Chromium photograph the ``/hybridflow`` page and Dask's
``/status`` page while it trains. Needs ``chromium`` on ``PATH`` (Debian:
``apt-get install chromium``). Run: ``python docs/make_screenshots.py``.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from tornado.websocket import websocket_connect

from hybridflow_dask.backends.dask import DaskBackend
from hybridflow_dask.examples.grpo.driver import run_demo

logger = logging.getLogger(__name__)

DOCS = Path(__file__).resolve().parent


def screenshot(url: str, out: Path, wait_s: float) -> None:
    """Open ``url`` in headless Chromium, wait real time (Bokeh draws over a websocket), save."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        flags = [
            "--headless",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--remote-debugging-port=0",
            "--remote-allow-origins=*",
            f"--user-data-dir={profile}",
            "--window-size=1400,900",
        ]
        if os.geteuid() == 0:
            flags.append("--no-sandbox")
        browser = subprocess.Popen(
            [chromium, *flags, "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            port = _devtools_port(Path(profile))
            png = asyncio.run(_capture(port, url, wait_s))
        finally:
            browser.terminate()
            browser.wait(timeout=30)
    out.write_bytes(png)
    logger.info("wrote %s", out)


def _devtools_port(profile: Path, timeout_s: float = 30) -> int:
    """Chromium writes the port it picked to ``DevToolsActivePort`` in its profile."""
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if marker.exists() and marker.read_text().strip():
            return int(marker.read_text().split()[0])
        time.sleep(0.1)
    raise RuntimeError("chromium did not open its DevTools port")


async def _capture(port: int, url: str, wait_s: float) -> bytes:
    """Drive one tab over the DevTools protocol: navigate, wait, capture a PNG."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/json/new?about:blank", method="PUT")
    with urllib.request.urlopen(request, timeout=10) as response:
        target = json.loads(response.read())
    conn = await websocket_connect(target["webSocketDebuggerUrl"])
    ids = itertools.count(1)

    async def send(method: str, **params: object) -> dict:
        msg_id = next(ids)
        await conn.write_message(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(await conn.read_message())
            if reply.get("id") == msg_id:
                return reply.get("result", {})

    await send("Page.enable")
    size = {"width": 1400, "height": 900, "deviceScaleFactor": 1, "mobile": False}
    await send("Emulation.setDeviceMetricsOverride", **size)
    await send("Page.navigate", url=url)
    await asyncio.sleep(wait_s)
    shot = await send("Page.captureScreenshot", format="png")
    conn.close()
    return base64.b64decode(shot["data"])


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with DaskBackend() as backend:
        done = threading.Event()

        def train() -> None:
            try:
                run_demo(steps=400, backend=backend)
            finally:
                done.set()

        loop = threading.Thread(target=train, daemon=True)
        loop.start()
        time.sleep(12)  # cluster up, groups made, enough steps for stable percentiles
        screenshot(backend.groups_page, DOCS / "dashboard.png", wait_s=2)
        screenshot(backend.dashboard_link, DOCS / "dask_status.png", wait_s=8)
        done.wait(timeout=300)
        loop.join(timeout=30)


if __name__ == "__main__":
    main()
