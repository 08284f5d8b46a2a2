"""The README's twenty-line example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

# Every test here starts processes (see tests/conftest.py).
pytestmark = pytest.mark.cluster

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs_and_prints_the_chained_rows(tmp_path):
    text = README.read_text()
    section = text[text.index("## Twenty lines") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tensor([ -0., -10., -20., -30., -40., -50., -60.])" in done.stdout
