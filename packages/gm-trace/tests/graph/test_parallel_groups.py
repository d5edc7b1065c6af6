"""Groups as values (issue 37): a role the run lacks is an error, never the world."""

from __future__ import annotations

import groups_bodies as bodies
import pytest

from gm_config import MissingGroupError, Role
from gm_trace import ParallelGroups

pytestmark = pytest.mark.distributed


def test_a_missing_role_is_an_error_naming_it_and_the_roles_there_are(dist_pool):
    for said in dist_pool(2).run(bodies.ask_for_missing_roles):
        assert "no 'cp' process group; its roles are: 'fsdp'" in said["groups"]
        # The fsdp pass given no fsdp group: an error, where it used to shard over the world.
        assert "no 'fsdp' process group; its roles are: none" in said["fsdp pass"]


def test_group_names_map_back_to_their_roles(dist_pool):
    for found in dist_pool(2).run(bodies.roles_of_group_names):
        assert found["world"] is Role.FSDP and found["own"] is Role.TP
        assert found["same ranks"] is Role.TP and found["names differ"]
        assert found["unknown"] is None
        assert found["roles"] == ["fsdp", "tp"]


def test_groups_without_torch_distributed_hold_no_role():
    groups = ParallelGroups()
    assert groups.roles == () and Role.FSDP not in groups and groups.size(Role.TP) == 1
    assert groups.optional(Role.EP) is None
    with pytest.raises(MissingGroupError, match="no 'ep' process group; its roles are: none"):
        groups.get(Role.EP)
