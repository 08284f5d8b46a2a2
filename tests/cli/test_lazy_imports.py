"""``import hybridflow_dask`` and the command's quick answers load neither torch nor Dask."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import hybridflow_dask

HEAVY = ("torch", "distributed", "dask", "tensordict", "numpy")

PROBE = """
import sys
from hybridflow_dask.cli import main
try:
    main(ARGS)
except SystemExit:
    pass
print("LOADED", *sorted(m for m in {heavy!r} if m in sys.modules))
"""


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["demo", "--help"],
        ["demo", "--steps", "abc"],
        ["demo", "--backend", "x"],
        ["--bogus"],
    ],
)
def test_quick_answers_import_nothing_heavy(program, args):
    ran = program(PROBE.format(heavy=HEAVY).replace("ARGS", repr(args)))
    assert ran.returncode == 0, ran.stderr
    loaded = ran.stdout.strip().splitlines()[-1].split()[1:]
    assert loaded == []


def test_importing_the_package_loads_nothing_heavy(program):
    ran = program(
        f"import sys, hybridflow_dask\nprint(*sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == ""


def test_every_public_name_resolves_to_its_module():
    for name in hybridflow_dask.__all__:
        value = getattr(hybridflow_dask, name)
        module = importlib.import_module(hybridflow_dask._EXPORTS[name], "hybridflow_dask")
        assert value is getattr(module, name)
    assert set(hybridflow_dask.__all__) <= set(dir(hybridflow_dask))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hybridflow_dask.nope  # noqa: B018


def test_type_checking_imports_name_exactly_the_exports():
    tree = ast.parse(Path(hybridflow_dask.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
    )
    imported = {
        alias.name: "." + node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert imported == hybridflow_dask._EXPORTS


def test_version_comes_from_the_installed_metadata(program):
    ran = program(
        "import sys, hybridflow_dask\n"
        "from importlib.metadata import version\n"
        "print(hybridflow_dask.__version__ == version('hybridflow-dask'), "
        "'__version__' in dir(hybridflow_dask))\n"
        f"print(*sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["True True", ""]
