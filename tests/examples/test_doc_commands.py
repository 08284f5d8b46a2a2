"""Every shell command in the README, CONTRIBUTING.md and docs/ runs as written from a
fresh clone (set up with ``scripts/setup.sh``), or its comment says why it cannot run in
one: the tags listed in CONTRIBUTING.md (*Commands in the README and the docs*).

Untagged commands run here, each in a copy of the checkout's files (what a clone has, no
build outputs) whose ``.venv`` is this checkout's. ``[long]`` ones are not run; the
script each names must exist and know every ``--option`` given to it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster  # commands run in processes of their own

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
TAGS = {"long", "gpu", "cluster", "slurm", "root", "network", "template"}
BLOCK = re.compile(r"^[ \t]*```(bash|sh|console)[ \t]*\n(.*?)^[ \t]*```", re.M | re.S)
TAG = re.compile(r"\[([a-z]+)\]")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str
    tags: frozenset[str]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def split_comment(line: str) -> tuple[str, str]:
    """``(command, comment)``: the comment starts at the first ``#`` outside quotes that
    begins a word, as in the shell."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :]
    return line.rstrip(), ""


def commands_of(page: Path) -> list[Command]:
    text = page.read_text(encoding="utf-8")
    name = page.relative_to(ROOT).as_posix()
    found: list[Command] = []
    for block in BLOCK.finditer(text):
        kind, body = block.group(1), block.group(2)
        first_line = text.count("\n", 0, block.start(2)) + 1
        block_tags: set[str] = set()
        pending = ""
        seen_command = False
        for offset, raw in enumerate(body.splitlines()):
            line = raw.strip()
            if kind == "console":
                if not line.startswith("$ "):
                    continue  # output
                line = line[2:]
            command, comment = split_comment(line)
            tags = set(TAG.findall(comment)) & TAGS
            if not command:
                if not seen_command and not pending:
                    block_tags |= tags  # a comment line at the top tags the whole block
                continue
            seen_command = True
            if command.endswith("\\"):
                pending += command[:-1] + " "
                continue
            whole = pending + command
            pending = ""
            found.append(Command(name, first_line + offset, whole, frozenset(tags | block_tags)))
    return found


ALL = [command for page in PAGES for command in commands_of(page)]


def test_the_pages_have_commands_and_the_quick_start_is_tagged():
    readme = [c for c in ALL if c.page == "README.md"]
    assert [c.text for c in readme[:2]] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    assert all("long" in c.tags for c in readme[:2])
    assert len(ALL) >= 20, [str(c) for c in ALL]


def test_the_quick_start_commands_are_the_ones_ci_and_the_scripts_use():
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert "bash scripts/setup.sh" in demo and ".venv/bin/hybridflow-dask demo" in demo
    test = (ROOT / "scripts" / "test.sh").read_text()
    assert "bash scripts/setup.sh" in test and "mkdocs build --strict" in test


def test_no_command_uses_a_bare_python_or_pip():
    """A fresh shell has no virtual environment: ``python`` may lack the project or not
    exist at all (the issue this test came from: ``ModuleNotFoundError: dask``)."""
    bare = [
        str(c)
        for c in ALL
        if shlex.split(c.text)[0] in {"python", "python3", "pip", "pip3", "pytest", "mkdocs"}
        and "template" not in c.tags
    ]
    assert not bare, "use .venv/bin/..., or tag the command:\n" + "\n".join(bare)


@pytest.mark.parametrize("command", [c for c in ALL if "long" in c.tags], ids=str)
def test_a_long_command_names_a_script_that_exists_and_knows_its_options(command):
    words = shlex.split(command.text.split("&&")[0])
    program = words[0]
    runs_a_file = program.endswith("/python") and len(words) > 1 and words[1] != "-m"
    if program == "bash" or runs_a_file:
        program, words = words[1], words[1:]
    path = ROOT / program
    assert path.exists(), f"{command}: {program} does not exist"
    options = [word.split("=")[0] for word in words[1:] if word.startswith("--")]
    if path.suffix == ".py" and options:
        source = path.read_text()
        unknown = [o for o in options if f'"{o}"' not in source]
        assert not unknown, f"{command}: {program} has no option {unknown}"
    if path.name == "demo.sh" and options:  # its options are the demo command's
        source = (ROOT / "hybridflow_dask" / "cli.py").read_text()
        assert all(f'"{o}"' in source for o in options), command


def _fresh_copy(into: Path) -> Path:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
    )
    if listed.returncode != 0:
        pytest.skip("needs the git checkout (a source tree without .git has no file list)")
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    (into / ".venv").symlink_to(ROOT / ".venv", target_is_directory=True)
    return into


RUNNABLE = [c for c in ALL if not c.tags]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("needs .venv (bash scripts/setup.sh)")
    return _fresh_copy(tmp_path_factory.mktemp("clone"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", RUNNABLE, ids=str)
def test_an_untagged_command_runs_as_written_from_a_fresh_clone(command, clone):
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH"}}
    done = subprocess.run(
        ["bash", "-c", command.text],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, (
        f"{command} exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )
