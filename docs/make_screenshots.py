"""Dashboard screenshots while worker groups are busy: docs/dashboard.png, docs/dask_status.png.

Starts a ``DaskBackend()`` (its own loopback cluster), makes a few groups that look like an
RLHF step, calls them in a loop from a thread, and has headless Chromium photograph the
``/hybridflow`` page and Dask's ``/status`` page. Needs ``chromium`` on ``PATH`` (Debian:
``apt-get install chromium``). Run: ``python docs/make_screenshots.py``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import os
import random
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from tornado.websocket import websocket_connect

import hybridflow_dask as hf
from hybridflow_dask.backends.dask import DaskBackend

logger = logging.getLogger(__name__)

DOCS = Path(__file__).resolve().parent


class Rollout(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def generate_sequences(self, step: int) -> int:
        time.sleep(random.uniform(0.05, 0.15))
        return step

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def update_actor(self, step: int) -> int:
        time.sleep(random.uniform(0.03, 0.08))
        if step % 17 == 16 and self.rank == 1:
            raise RuntimeError("loss is NaN")  # a few errors, so the column shows something
        return step


class Critic(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def compute_values(self, step: int) -> int:
        time.sleep(random.uniform(0.02, 0.05))
        return step

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def update_critic(self, step: int) -> int:
        time.sleep(random.uniform(0.02, 0.06))
        return step


class Reference(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def compute_ref_log_prob(self, step: int) -> int:
        time.sleep(random.uniform(0.01, 0.04))
        return step


def train(groups: dict[str, hf.WorkerGroup], stop: threading.Event) -> None:
    """A PPO-shaped loop: generate, score with critic and reference, update both."""
    step = 0
    while not stop.is_set():
        groups["actor_rollout"].generate_sequences(step)
        groups["critic"].compute_values(step)
        groups["ref_policy"].compute_ref_log_prob(step)
        groups["critic"].update_critic(step)
        with contextlib.suppress(RuntimeError):  # the planted NaN errors
            groups["actor_rollout"].update_actor(step)
        step += 1


def screenshot(url: str, out: Path, wait_s: float) -> None:
    """Open ``url`` in headless Chromium, wait real time (Bokeh draws over a websocket), save."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
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
        groups = {
            "actor_rollout": hf.WorkerGroup(
                hf.ResourcePool([2]), Rollout, backend=backend, name_prefix="actor_rollout"
            ),
            "critic": hf.WorkerGroup(
                hf.ResourcePool([2]), Critic, backend=backend, name_prefix="critic"
            ),
            "ref_policy": hf.WorkerGroup(
                hf.ResourcePool([1]), Reference, backend=backend, name_prefix="ref_policy"
            ),
        }
        stop = threading.Event()
        loop = threading.Thread(target=train, args=(groups, stop), daemon=True)
        loop.start()
        try:
            time.sleep(15)  # enough steps for stable percentiles and a full task stream
            screenshot(backend.groups_page, DOCS / "dashboard.png", wait_s=2)
            screenshot(backend.dashboard_link, DOCS / "dask_status.png", wait_s=8)
        finally:
            stop.set()
            loop.join(timeout=30)
            for group in groups.values():
                group.shutdown()


if __name__ == "__main__":
    main()
