"""The built wheel works on its own: installed into a fresh virtual environment, its
command answers and the README's example runs, importing the package from the wheel.

The fresh environment gets torch, Dask and the other dependencies by reading this
project's ``.venv`` site-packages through a ``.pth`` file (installing them again would
take minutes), and the wheel itself with ``--no-deps``. A ``.pth`` line only appends a
directory to ``sys.path``; the ``.pth`` files inside it (the editable install's import
hook among them) are not run, so ``hybridflow_dask`` can come only from the wheel. Every
command runs from an empty directory with no ``PYTHONPATH``, so the source tree is not on
``sys.path`` either.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

# Every test here starts processes (see tests/conftest.py).
pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
#: What building the wheel needs from the source tree (the rest is left out).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "hybridflow_dask_sizeof.py")
TIMEOUT_S = 180


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def _readme_example() -> str:
    """The README's first Python example (as ``tests/examples/test_readme.py`` finds it),
    with the cluster sized up front as docs/quickstart.md advises (``hf.init(n_workers=5)``): its
    five workers start together instead of two, then three (~30 s saved on 2 cores).
    ``tests/examples/test_readme.py`` runs the example exactly as written."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Twenty lines") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "no python block under '## Twenty lines' in README.md"
    code, found = re.subn(
        r'^(if __name__ == "__main__":.*\n)',
        r"\1    hf.init(n_workers=5)\n",
        match.group(1),
        count=1,
        flags=re.M,
    )
    assert found == 1, "the README example has no 'if __name__ == \"__main__\":' line"
    return code


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the sources (the checkout is left untouched)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "hybridflow_dask",
        src / "hybridflow_dask",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    out = tmp_path_factory.mktemp("dist")
    _run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"),
            *("--quiet", "--wheel-dir", str(out), str(src)),
        ],
        cwd=out,
    )
    (built,) = out.glob("hybridflow_dask-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed; its ``bin`` directory."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=env_dir,
        ).stdout.strip()
    )
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "project_dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    _run(
        [
            *(sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"),
            *("--no-deps", "--no-index", str(wheel)),
        ],
        cwd=env_dir,
    )
    return env_dir / "bin"


def test_the_wheel_holds_the_package_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "hybridflow_dask/py.typed" in names
    assert "hybridflow_dask/backends/dask/hybridflow.yaml" in names
    assert "hybridflow_dask_sizeof.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert not [n for n in names if n.startswith("tests/") or "__pycache__" in n]


def test_the_installed_package_comes_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    probe = (
        "import hybridflow_dask, importlib.metadata as md\n"
        "print(hybridflow_dask.__file__)\n"
        "print(hybridflow_dask.__version__, md.version('hybridflow-dask'))\n"
    )
    ran = _run([str(installed / "python"), "-c", probe], cwd=tmp_path)
    where, versions = ran.stdout.splitlines()[:2]
    assert Path(where).resolve().is_relative_to(installed.parent.resolve()), where
    version, metadata_version = versions.split()
    assert version == metadata_version != "0+unknown"


def test_the_installed_command_answers_help(installed: Path, tmp_path: Path) -> None:
    done = _run([str(installed / "hybridflow-dask"), "--help"], cwd=tmp_path)
    assert "demo" in done.stdout


def test_the_readme_example_runs_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(_readme_example())
    done = _run([str(installed / "python"), str(script)], cwd=tmp_path)
    assert "tensor([ -0., -10., -20., -30., -40., -50., -60.])" in done.stdout
