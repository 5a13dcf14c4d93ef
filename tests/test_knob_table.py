"""The one table of knobs (ONEBIT_MOE_KNOBS in the patched tree's include/onebit-moe.h) against the
sidecar's own lists: the C API struct's fields in order (llama/moe_api.py FIELDS, the ABI), every
variable known to the policy (constants.ENV_ALL) and documented (docs/policy.md), every flag
documented, and the flag table of docs/policy.md's "The knobs" section (which README.md links to
instead of holding a copy) row for row. A knob added to the table and forgotten here, or the other
way round, fails."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from onebit_predict.constants import ENV_ALL
from onebit_predict.llama.moe_api import FIELDS
from onebit_predict.llama.paths import llama_tree

pytestmark = pytest.mark.needs_build

ROW = re.compile(r'X\((\w+),\s*"(\w+)",\s*"([-a-z]*)"\)')
POLICY_MD = Path(__file__).resolve().parent.parent / "docs" / "policy.md"


def knob_table() -> list[tuple[str, str, str]]:
    """(field, variable, flag) of every row of ONEBIT_MOE_KNOBS, in order."""
    text = (llama_tree() / "include" / "onebit-moe.h").read_text()
    start = text.index("#define ONEBIT_MOE_KNOBS(X)")
    end = text.index("\n\n", start)
    rows = ROW.findall(text[start:end])
    assert rows, "ONEBIT_MOE_KNOBS has no row the pattern reads"
    return rows


def test_the_struct_fields_are_the_table():
    assert [(f, v) for f, v, _ in knob_table()] == list(FIELDS)


def test_every_knob_is_known_and_documented():
    docs = POLICY_MD.read_text()
    for field, variable, flag in knob_table():
        assert variable in ENV_ALL, f"{variable} ({field}) is not in constants.ENV_ALL"
        assert variable in docs, f"{variable} is not in docs/policy.md"
        assert not flag or flag in docs, f"{flag} is not in docs/policy.md"


def test_the_pattern_reads_a_row_and_misses_none():
    """The row pattern itself: a row with a flag, one without; the table's row count is its X( count."""
    assert ROW.findall('X(depth, "ONEBIT_MOE_PREDICT_DEPTH", "--moe-predict-depth") X(out, "V", "")') == [
        ("depth", "ONEBIT_MOE_PREDICT_DEPTH", "--moe-predict-depth"),
        ("out", "V", ""),
    ]
    text = (llama_tree() / "include" / "onebit-moe.h").read_text()
    block = text[text.index("#define ONEBIT_MOE_KNOBS(X)") :]
    block = block[: block.index("\n\n")]
    assert block.count("X(") == len(knob_table())  # the define names its parameter (X), never X(


README_MD = POLICY_MD.parent.parent / "README.md"
KNOB_ROW = re.compile(r"^\| `(--[a-z-]+)` \| `(ONEBIT_\w+)` \|", re.MULTILINE)


def knobs_section() -> str:
    """docs/policy.md's "## The knobs" section: the table of every flag (the README links to it)."""
    docs = POLICY_MD.read_text()
    assert "\n## The knobs\n" in docs, "docs/policy.md has no section '## The knobs'"
    section = docs.split("\n## The knobs\n", 1)[1]
    return section.split("\n## ", 1)[0]


def test_the_knobs_section_has_a_row_for_every_flag():
    """Its table: one row per knob with a flag, flag and variable as the X-macro table pairs them."""
    rows = KNOB_ROW.findall(knobs_section())
    want = {flag: variable for _, variable, flag in knob_table() if flag}
    assert len(rows) == len(dict(rows)), f"a flag has two rows: {rows}"
    assert dict(rows) == want


def test_the_readme_links_to_the_table_and_holds_none():
    readme = README_MD.read_text()
    assert KNOB_ROW.findall(readme) == [], "the knob table lives in docs/policy.md#the-knobs, not in README.md"
    assert "(docs/policy.md#the-knobs)" in readme
