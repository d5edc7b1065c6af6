"""Graph Mode pass infrastructure: ``GraphPass``, ``PassPipeline`` and the pass registry.

Never imports torch. Passes that need torch live in other distributions and are found by
name through the entry-point group ``gm_passes.passes``.
"""

from gm_passes.base import GraphPass, NoProcessGroups, PassContext, PassResult, ProcessGroups
from gm_passes.base_passes import CanonicalizeGraph, DeadCodeElimination
from gm_passes.graph_diff import GraphChange, GraphOutline
from gm_passes.pipeline import (
    BASE_PASSES,
    CHANGES_FILE,
    GraphPassError,
    PassPipeline,
    PassRecord,
    order_passes,
    selected_passes,
)
from gm_passes.registry import (
    ENTRY_POINT_GROUP,
    PassNotFoundError,
    available_passes,
    get_pass,
    register_pass,
    unregister_pass,
)

__all__ = [
    "BASE_PASSES",
    "CHANGES_FILE",
    "ENTRY_POINT_GROUP",
    "CanonicalizeGraph",
    "DeadCodeElimination",
    "GraphChange",
    "GraphOutline",
    "GraphPass",
    "GraphPassError",
    "NoProcessGroups",
    "PassContext",
    "PassNotFoundError",
    "PassPipeline",
    "PassRecord",
    "PassResult",
    "ProcessGroups",
    "available_passes",
    "get_pass",
    "order_passes",
    "register_pass",
    "selected_passes",
    "unregister_pass",
]
