"""The one table of knobs (ONEBIT_MOE_KNOBS in the patched tree's include/onebit-moe.h) against the
sidecar's own lists: the C API struct's fields in order (llama/moe_api.py FIELDS, the ABI), every
variable known to the policy (constants.ENV_ALL) and documented (docs/policy.md), every flag
documented. A knob added to the table and forgotten here, or the other way round, fails."""

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
