"""Dashboard screenshots while worker groups are busy: docs/dashboard.png, docs/dask_status.png.

Starts a ``DaskBackend`` (its own loopback cluster of 2 workers), runs two colocated groups
on it from a thread (a non-blocking policy -> critic -> policy chain of 8 MiB tensors each
step, one rank stalling for 10 s once, ``update`` failing every fifth step), and has
headless Chromium photograph the ``/hybridflow`` page and Dask's ``/status`` page while
the stall is under way. Needs ``chromium`` on ``PATH`` (Debian:
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

import torch
from tornado.websocket import websocket_connect

import hybridflow_dask as hf
from hybridflow_dask.backends.dask import DaskBackend

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


class Policy(hf.Worker):
    """A rank that generates, and learns from the critic's values; rank 1 stalls once and
    ``update`` fails every fifth step, so the page has a straggler and errors to show."""

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def generate(self, step: int) -> torch.Tensor:
        time.sleep(STALL_S if (step == STALL_STEP and self.rank == 1) else 0.05)
        return torch.randn(BATCH_ELEMENTS)  # 8 MiB per rank

    @hf.register(hf.Dispatch.ALL_TO_ALL)
    def update(self, values: torch.Tensor, step: int) -> float:
        if step % 5 == 0:
            raise ValueError(f"loss is NaN at step {step} (rank {self.rank})")
        time.sleep(0.02)
        return float(values.mean())


class Critic(hf.Worker):
    @hf.register(hf.Dispatch.ALL_TO_ALL, blocking=False)
    def values(self, samples: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return samples * 0.5


STALL_STEP, STALL_S = 12, 10.0
BATCH_ELEMENTS = 2 * 1024 * 1024


def run(backend: DaskBackend, stop: threading.Event) -> None:
    """Two colocated groups on one pool, a non-blocking chain per step, to the end."""
    pool = hf.ResourcePool([2])
    policy = hf.WorkerGroup(
        pool, hf.ClassWithInitArgs(Policy), backend=backend, name_prefix="policy"
    )
    critic = hf.WorkerGroup(
        pool, hf.ClassWithInitArgs(Critic), backend=backend, name_prefix="critic"
    )
    step = 0
    while not stop.is_set():
        step += 1
        values = critic.values(policy.generate(step))
        try:
            policy.update(values, [step] * 2)
        except ValueError as exc:
            logger.info("step %d: %s", step, exc)
    policy.shutdown()
    critic.shutdown()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with DaskBackend(n_workers=2) as backend:
        stop = threading.Event()
        loop = threading.Thread(target=run, args=(backend, stop), daemon=True)
        loop.start()
        time.sleep(8)  # cluster up, groups made, the stall under way (with some errors)
        screenshot(backend.groups_page, DOCS / "dashboard.png", wait_s=3)
        screenshot(backend.dashboard_link, DOCS / "dask_status.png", wait_s=8)
        stop.set()
        loop.join(timeout=60)


if __name__ == "__main__":
    main()
