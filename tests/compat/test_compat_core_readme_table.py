"""verl parity: the "Coming from verl" table (``docs/concepts.md``, *Every difference, in
detail*) lists the deliberate differences, the exception types of input checks first
among them."""

from __future__ import annotations

from pathlib import Path

from hybridflow_dask.worker_group import RAY_ONLY_KEYWORDS

CONCEPTS = Path(__file__).resolve().parents[2] / "docs" / "concepts.md"


def verl_section() -> str:
    text = CONCEPTS.read_text(encoding="utf-8")
    start = text.index("## Every difference, in detail")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def table_rows(section: str) -> list[str]:
    return [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]


def test_verl_table_says_input_checks_raise_value_or_type_errors():
    rows = [row for row in table_rows(verl_section()) if "AssertionError" in row]
    assert len(rows) == 1, "one row should compare verl's assertions with the errors here"
    assert "ValueError" in rows[0] and "TypeError" in rows[0]


def test_verl_table_names_every_ignored_verl_keyword():
    section = verl_section()
    missing = [name for name in sorted(RAY_ONLY_KEYWORDS) if f"`{name}`" not in section]
    assert not missing, f"ignored keywords missing from docs/concepts.md's table: {missing}"


def test_verl_table_rows_have_three_cells():
    for row in table_rows(verl_section()):
        cells = row.strip().strip("|").split(" | ")
        assert len(cells) == 3, row
