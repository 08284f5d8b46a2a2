"""Backends by entry point: ``--backend NAME`` takes any installed backend.

The end-to-end test builds a tiny third-party package (a backend wrapping
``hybridflow_dask.testing.tiny_backend``, registered under the ``hybridflow_dask.backends``
group in its own ``pyproject.toml``), installs it with pip into a fresh virtual
environment, and runs the demo there with ``--backend tiny``. The environment reads this
project's ``.venv`` site-packages and source tree through a ``.pth`` file, so nothing is
downloaded (``--no-index --no-deps --no-build-isolation``); the package is installed
only there, so this project's own environment never sees ``tiny``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from hybridflow_dask.backends.local import LocalBackend
from hybridflow_dask.backends.registry import (
    ENTRY_POINT_GROUP,
    available_backends,
    backend_factory,
    open_backend,
)
from hybridflow_dask.cli import main

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180

PYPROJECT = f"""\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "hf-tiny-backend"
version = "0.1.0"

[tool.setuptools]
py-modules = ["hf_tiny_backend"]

[project.entry-points."{ENTRY_POINT_GROUP}"]
tiny = "hf_tiny_backend:PackagedTinyBackend"
"""

MODULE = '''\
"""A third-party backend: the guide's TinyBackend, shipped in its own package."""

from hybridflow_dask.testing.tiny_backend import TinyBackend


class PackagedTinyBackend(TinyBackend):
    """Every rank in the driver's process; registered as ``tiny``."""
'''

CLI = "import sys; from hybridflow_dask.cli import main; sys.exit(main(sys.argv[1:]))"


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _ok(done: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert done.returncode == 0, (
        f"{done.args} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )
    return done


# ---- the registry in this process (no process started) ------------------------------------


def test_the_projects_own_backends_are_registered():
    assert {"dask", "local", "ray"} <= set(available_backends())
    assert backend_factory("local") is LocalBackend


def test_an_unknown_backend_is_a_value_error_listing_the_installed_ones():
    with pytest.raises(ValueError, match="unknown backend 'nope'; installed backends: ") as info:
        open_backend("nope")
    for name in ("dask", "local", "ray"):
        assert name in str(info.value)
    with pytest.raises(TypeError, match="a backend name must be a str"):
        open_backend(3)  # type: ignore[arg-type]


def test_a_keyword_the_factory_does_not_take_is_a_type_error_naming_the_backend():
    with pytest.raises(TypeError, match="backend 'local' does not take address"):
        open_backend("local", address="tcp://127.0.0.1:8786")
    backend = open_backend("local")
    try:
        assert isinstance(backend, LocalBackend)
    finally:
        backend.shutdown()


def test_the_cli_refuses_an_unknown_backend_in_one_line_listing_the_installed(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--backend", "nope", "--steps", "1"])
    assert info.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert "argument --backend: unknown backend 'nope'; installed: dask, local, ray" in line


# ---- a third-party package, installed into a fresh environment --------------------------------


@pytest.fixture(scope="module")
def tiny_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment holding the ``hf-tiny-backend`` package; its python."""
    package = tmp_path_factory.mktemp("hf_tiny_backend")
    (package / "pyproject.toml").write_text(PYPROJECT)
    (package / "hf_tiny_backend.py").write_text(MODULE)
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(
        _ok(
            _run(
                [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                cwd=env_dir,
            )
        ).stdout.strip()
    )
    # The project's dependencies, its metadata (the local/dask/ray entry points) and its
    # source tree (a .pth line does not run the editable install's own .pth import hook).
    ours = dict.fromkeys([*(sysconfig.get_paths()[k] for k in ("purelib", "platlib")), str(ROOT)])
    (site / "project_dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    _ok(
        _run(
            [
                *(sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"),
                *("--no-deps", "--no-index", "--no-build-isolation", str(package)),
            ],
            cwd=env_dir,
        )
    )
    return python


@pytest.mark.cluster
def test_the_demo_runs_on_a_backend_a_package_registers(tiny_env: Path, tmp_path: Path):
    out = tmp_path / "demo"
    args = ["demo", "--backend", "tiny", "--workers", "1", "--steps", "2", "--out", str(out)]
    ran = _ok(_run([str(tiny_env), "-c", CLI, *args], cwd=tmp_path))
    assert "backend:        tiny (no dashboard)" in ran.stdout
    assert "2 steps on 1 ranks" in ran.stdout
    steps = json.loads((out / "metrics.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [1, 2]


@pytest.mark.cluster
def test_the_installed_backend_is_listed_and_refuses_what_it_cannot_run(
    tiny_env: Path, tmp_path: Path
):
    listed = _ok(_run([str(tiny_env), "-c", CLI, "demo", "--help"], cwd=tmp_path)).stdout
    assert "dask, local, ray, tiny" in " ".join(listed.split())
    unknown = _run([str(tiny_env), "-c", CLI, "demo", "--backend", "tinny"], cwd=tmp_path)
    assert unknown.returncode == 2
    assert "unknown backend 'tinny'; installed: dask, local, ray, tiny" in unknown.stderr
    # Two ranks in the driver's process cannot join one gloo group: one line, at once.
    two = _run(
        [str(tiny_env), "-c", CLI, "demo", "--backend", "tiny", "--steps", "1", "--out", "o"],
        cwd=tmp_path,
    )
    assert two.returncode == 2, two.stderr[-2000:]
    assert "needs a process per rank" in two.stderr and "backend 'tiny'" in two.stderr
    with_address = _run(
        [str(tiny_env), "-c", CLI, "demo", "--backend", "tiny", "--address", "x:1"],
        cwd=tmp_path,
    )
    assert with_address.returncode == 2
    assert "backend 'tiny' does not take address" in with_address.stderr
    # The package went into that environment only.
    assert "tiny" not in available_backends()
