"""docs/architecture.md names the passes that are registered (issue #41 item 9: its layer
table listed five of twelve): each distribution's row lists its own entry points, and the
step diagram gives them in the order the pipeline puts them in."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from gm_passes.pipeline import order_passes
from gm_passes.registry import ENTRY_POINT_GROUP, get_pass

ARCHITECTURE = Path(__file__).resolve().parents[4] / "docs" / "architecture.md"


def _entry_points(distribution: str) -> list[str]:
    found = metadata.distribution(distribution).entry_points
    return sorted(ep.name for ep in found if ep.group == ENTRY_POINT_GROUP)


def test_the_architecture_lists_every_registered_pass_in_pipeline_order() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    for distribution in ("gm-passes", "gm-trace"):
        row = next(line for line in text.splitlines() if line.startswith(f"| `{distribution}`"))
        listed = row.rsplit("passes", 1)[-1]
        names = sorted(re.findall(r"`(\w+)`", listed))
        assert names == _entry_points(distribution), (distribution, row)
    registered = [*_entry_points("gm-passes"), *_entry_points("gm-trace")]
    order = order_passes([get_pass(name)() for name in registered])
    diagram = re.search(r"\|\s+(dce -> .*?backend)\n", text, re.DOTALL)
    assert diagram is not None, "the step diagram lost its pass order line"
    shown = re.findall(r"\w+", diagram.group(1).replace("|", " "))
    assert shown == order, (shown, order)
