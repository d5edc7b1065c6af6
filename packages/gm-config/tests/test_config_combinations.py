"""The combinations of parallel dimensions graph mode refuses (issue #41 item 9): one table,
``gm_config.combinations.UNSUPPORTED``; the user guide's list is generated from it and must
not drift (gm-trainer's test_job_config.py checks that gm-train refuses each entry, in the
table's words)."""

from __future__ import annotations

import re
from pathlib import Path

from gm_config.combinations import UNSUPPORTED, limitations_markdown, refused

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "user-guide.md"
BLOCK = re.compile(
    r"<!-- refused combinations: begin [^>]*-->\n(.*?)  <!-- refused combinations: end -->",
    re.DOTALL,
)


def test_the_user_guide_lists_exactly_the_refused_combinations_of_the_table() -> None:
    found = BLOCK.search(GUIDE.read_text(encoding="utf-8"))
    assert found is not None, f"{GUIDE} has no generated block of refused combinations"
    assert found.group(1) == limitations_markdown(), (
        "docs/user-guide.md's list of refused combinations differs from "
        "gm_config.combinations.UNSUPPORTED; paste this between its markers:\n"
        + limitations_markdown()
    )


def test_an_entry_is_refused_when_all_its_dimensions_are_above_one() -> None:
    for entry in UNSUPPORTED:
        degrees = dict.fromkeys(entry.dims, 2)
        assert refused(degrees, gm_train=True) is entry
        assert refused(degrees) is (None if entry.gm_train_only else entry)
        assert refused({**degrees, entry.dims[0]: 1}, gm_train=True) is None
    assert refused({"ep": 2, "pp": 2}, gm_train=True) is None  # EP x PP runs
    assert refused({"ep": 2, "dp_replicate": 2}, gm_train=True) is None  # EP x HSDP runs
    assert refused({"cp": 2, "pp": 2}, gm_train=True) is None  # CP x PP runs
    assert refused({"ep": 4, "dp_replicate": 1, "cp": 1}) is None
