"""A single-node SLURM cluster on this machine, for tests of ``dask_jobqueue`` launches.

``SingleNodeSlurm()`` writes a ``slurm.conf`` for this host into a temporary folder and
starts ``munged``, ``slurmctld`` and ``slurmd`` with their state, spool, pid and log
files there; ``SLURM_CONF`` points this process (and so ``sbatch``, ``squeue`` and
``scancel``, which dask-jobqueue runs) at it. On exit the daemons are stopped by the pids
they wrote and the folder is removed. Needs root (``slurmd`` runs jobs as their user) and
Debian's ``slurm-wlm`` and ``munge`` packages: ``install_if_missing()`` installs them
with ``apt-get`` when running as root (about 10-30 s); ``missing()`` says what is absent.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["SingleNodeSlurm", "install_if_missing", "missing"]

DAEMONS = ("munged", "slurmctld", "slurmd")
READY_TIMEOUT_S = 60.0


def missing() -> str | None:
    """Why a single-node SLURM cannot run here, or ``None``."""
    if os.geteuid() != 0:
        return "a single-node SLURM needs root (slurmd runs jobs as their user)"
    absent = [d for d in (*DAEMONS, "sbatch", "sinfo") if shutil.which(d) is None]
    if absent:
        return f"{', '.join(absent)} not installed (Debian packages slurm-wlm and munge)"
    return None


def install_if_missing() -> None:
    """``apt-get install slurm-wlm munge`` when running as root and a daemon is absent."""
    if os.geteuid() != 0 or all(shutil.which(d) for d in (*DAEMONS, "sbatch")):
        return
    if shutil.which("apt-get") is None:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, check=False)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"],
        env=env,
        capture_output=True,
        check=False,
    )


class SingleNodeSlurm:
    """munged + slurmctld + slurmd for this host, in a temporary folder."""

    def __init__(self, cpus: int | None = None, memory_mb: int = 8000) -> None:
        self.cpus = cpus or os.cpu_count() or 1
        self.memory_mb = memory_mb
        self.folder = Path()
        self._previous_conf: str | None = None
        self._pid_files: list[Path] = []

    def __enter__(self) -> SingleNodeSlurm:
        why = missing()
        if why is not None:
            raise RuntimeError(f"cannot start SLURM: {why}")
        self.folder = Path(tempfile.mkdtemp(prefix="hf-slurm-"))
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for pid_file in reversed(self._pid_files):
            with contextlib.suppress(OSError, ValueError):
                pid = int(pid_file.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):  # until it is gone
                    os.kill(pid, 0)
                    time.sleep(0.05)
        self._pid_files.clear()
        if self._previous_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._previous_conf
        shutil.rmtree(self.folder, ignore_errors=True)

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    def _start(self) -> None:
        host = socket.gethostname().split(".")[0]
        munge_socket = self.folder / "munge.socket"
        for sub in ("state", "spool", "log"):
            (self.folder / sub).mkdir()
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=hf",
                    f"SlurmctldHost={host}",
                    "SlurmUser=root",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={munge_socket}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    f"StateSaveLocation={self.folder / 'state'}",
                    f"SlurmdSpoolDir={self.folder / 'spool'}",
                    f"SlurmctldPidFile={self.folder / 'slurmctld.pid'}",
                    f"SlurmdPidFile={self.folder / 'slurmd.pid'}",
                    f"SlurmctldLogFile={self.folder / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={self.folder / 'log' / 'slurmd.log'}",
                    f"NodeName={host} CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN",
                    "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
                    "OverSubscribe=FORCE:4",
                    "",
                ]
            )
        )
        self._previous_conf = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(self.conf)
        munge_pid = self.folder / "munged.pid"
        self._daemon(
            [
                "munged",
                "--force",
                f"--socket={munge_socket}",
                f"--pid-file={munge_pid}",
                f"--log-file={self.folder / 'log' / 'munged.log'}",
                f"--seed-file={self.folder / 'munge.seed'}",
            ],
            munge_pid,
        )
        self._daemon(["slurmctld", "-f", str(self.conf)], self.folder / "slurmctld.pid")
        self._daemon(["slurmd", "-f", str(self.conf)], self.folder / "slurmd.pid")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:  # until the node takes jobs
            state = subprocess.run(
                ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True
            ).stdout.strip()
            if state in ("idle", "mix", "alloc"):
                return
            if time.monotonic() > deadline:
                log = (self.folder / "log" / "slurmctld.log").read_text(errors="replace")
                raise TimeoutError(f"SLURM node not idle after {READY_TIMEOUT_S}s: {log[-2000:]}")
            time.sleep(0.2)

    def _daemon(self, argv: list[str], pid_file: Path) -> None:
        """Start a daemon (it forks into the background) and remember its pid file."""
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
        deadline = time.monotonic() + 10
        while not pid_file.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv[0]} wrote no pid file {pid_file}")
            time.sleep(0.05)
        self._pid_files.append(pid_file)
