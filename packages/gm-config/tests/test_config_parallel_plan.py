"""``ParallelPlan``: every degree rule, torch-free, with errors that name the degrees."""

from __future__ import annotations

import dataclasses

import pytest

from gm_config import (
    Axis,
    ConfigError,
    MeshError,
    MissingGroupError,
    ParallelPlan,
    PassConfig,
    Role,
)
from gm_config.combinations import UNSUPPORTED, Unsupported


def test_defaults_are_one_of_everything_and_dp_shard_left_to_the_world():
    plan = ParallelPlan()
    assert plan.degrees() == {
        "dp_replicate": 1,
        "dp_shard": None,
        "tp": 1,
        "pp": 1,
        "pp_virtual_stages": 1,
        "cp": 1,
        "ep": 1,
    }
    assert plan.fsdp is None and plan.dp is None and plan.world_size is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tp = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        ParallelPlan(2)  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize("field", ["dp_replicate", "tp", "pp", "pp_virtual_stages", "cp", "ep"])
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2", None])
def test_a_degree_is_an_int_of_at_least_one(field, bad):
    with pytest.raises(MeshError) as info:
        ParallelPlan(**{field: bad})
    message = str(info.value)
    assert message.startswith(f"{field} (") and "must be an int >= 1" in message
    assert f"got {bad!r}" in message


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_dp_shard_is_an_int_or_none(bad):
    with pytest.raises(MeshError, match=r"dp_shard .*must be an int >= 1 or None"):
        ParallelPlan(dp_shard=bad)


def test_errors_name_the_other_spellings_of_a_degree():
    with pytest.raises(MeshError) as info:
        ParallelPlan(tp=0)
    assert "PassConfig.tp_size" in str(info.value) and "parallel.tp_size" in str(info.value)
    with pytest.raises(MeshError, match=r"dist\.dp_replicate"):
        ParallelPlan(dp_replicate=0)
    assert issubclass(MeshError, ConfigError) and issubclass(MeshError, ValueError)


@pytest.mark.parametrize("entry", UNSUPPORTED, ids=lambda e: "x".join(e.dims))
def test_the_plan_refuses_exactly_the_tables_library_entries(entry: Unsupported):
    """The plan's combination rules are the table's (gm_config.combinations): a library entry
    is refused naming each degree in every spelling and the table's words; a gm-train-only
    entry is the job's to refuse."""
    degrees = dict.fromkeys(entry.dims, 2)
    if entry.gm_train_only:
        ParallelPlan(**degrees)
        return
    with pytest.raises(MeshError) as info:
        ParallelPlan(**degrees)
    message = str(info.value)
    assert f"{entry.what} is not supported yet" in message, message
    for dim in entry.dims:
        assert f"{dim}=2 (" in message, message
    if "ep" in entry.dims:
        assert "PassConfig.ep_degree=2" in message and "parallel.ep_degree=2" in message


def test_combinations_that_run_are_accepted():
    for degrees in (
        {"ep": 2, "pp": 2},
        {"ep": 2, "tp": 2},
        {"cp": 2, "tp": 2, "dp_replicate": 2},
        {"pp": 2, "tp": 2, "dp_replicate": 2},
    ):
        assert ParallelPlan(**degrees).degrees().items() >= degrees.items()


def test_ep_must_divide_dp_shard_and_the_error_lists_the_sizes_it_may_take():
    with pytest.raises(MeshError) as info:
        ParallelPlan(dp_shard=6, ep=4)
    assert "ep=4" in str(info.value) and "6 data-parallel ranks" in str(info.value)
    assert "[1, 2, 3, 6]" in str(info.value)
    assert ParallelPlan(dp_shard=6, ep=3).ep == 3


def test_for_world_fills_dp_shard_with_the_ranks_left_over():
    plan = ParallelPlan(dp_replicate=2, tp=2, pp=2).for_world(16)
    assert plan.dp_shard == 2
    assert (plan.dp, plan.fsdp, plan.world_size) == (4, 2, 16)
    cp = ParallelPlan(cp=2).for_world(8)
    assert (cp.dp_shard, cp.fsdp, cp.dp) == (4, 8, 4)  # FSDP spans dp_shard x cp
    assert ParallelPlan(dp_shard=4, tp=2).for_world(8) == ParallelPlan(dp_shard=4, tp=2)


@pytest.mark.parametrize(
    ("degrees", "world", "says"),
    [
        ({"pp": 3}, 8, r"pp=3 .*must divide the world size 8; choose pp among \[1, 2, 4, 8\]"),
        ({"pp": 2, "tp": 3}, 8, r"tp=3 .*must divide the 4 ranks 8 / pp 2 leaves; .*\[1, 2, 4\]"),
        ({"tp": 2, "cp": 3}, 8, r"cp=3 .*the 4 ranks 8 / tp 2 leaves"),
        ({"dp_replicate": 3}, 4, r"dp_replicate=3 .*must divide the world size 4"),
        (
            {"dp_shard": 3},
            8,
            r"dp_shard=3 x cp=1 x tp=1 = 3, but the world has 8 ranks"
            r".*dp_shard=8 \(PassConfig.fsdp_degree=8\), or None",
        ),
        ({"ep": 3}, 4, r"ep=3 .*does not divide the 4 data-parallel ranks.*\[1, 2, 4\]"),
        ({"ep": 2, "pp": 2}, 2, r"ep=2 .*does not divide the 1 data-parallel ranks"),
        (
            {"ep": 4, "cp": 2},
            2,
            r"ep=4 .*does not divide the 2 data-parallel ranks of a stage \(dp_shard=1 .* x "
            r"cp=2 .*\); an ep group is made of ep of them \(choose ep among \[1, 2\]\)",
        ),
    ],
)
def test_for_world_refuses_degrees_the_world_does_not_hold(degrees, world, says):
    with pytest.raises(MeshError, match=says):
        ParallelPlan(**degrees).for_world(world)


@pytest.mark.parametrize("world", [0, -2, True, 2.5])
def test_for_world_needs_a_positive_world(world):
    with pytest.raises(MeshError, match="world size must be an int >= 1"):
        ParallelPlan().for_world(world)


def test_taking_a_mesh_fills_what_was_left_open_and_refuses_disagreement():
    mesh = ParallelPlan(dp_replicate=2, dp_shard=2, tp=2, cp=1)
    assert ParallelPlan().taking(mesh) == mesh
    assert ParallelPlan(dp_shard=2, tp=2).taking(mesh) == mesh
    with pytest.raises(
        MeshError,
        match=r"fsdp_degree=4 \(dp_shard=4 x cp=1\) but the FSDP group of the mesh has 2 ranks",
    ):
        ParallelPlan(dp_shard=4).taking(mesh)
    with pytest.raises(MeshError, match=r"tp=4 .* but the mesh has tp=2; .*build\(tp=4"):
        ParallelPlan(tp=4).taking(mesh)
    with pytest.raises(MeshError, match=r"ep=2 .* but the mesh has ep=1"):
        ParallelPlan(ep=2).taking(mesh)
    with pytest.raises(MeshError, match=r"pp=2 .* but the mesh has 1 pipeline stage"):
        ParallelPlan(pp=2).taking(mesh)
    with pytest.raises(MeshError, match=r"pp=1 .* but the mesh has 2 pipeline stage"):
        ParallelPlan().taking(ParallelPlan(pp=2, dp_shard=1))
    assert (
        ParallelPlan(pp=2, pp_virtual_stages=2)
        .taking(ParallelPlan(pp=2, dp_shard=1))
        .pp_virtual_stages
        == 2
    )


def test_gradient_sync_needs_the_fsdp_pass_for_ep_and_for_stages_of_several_ranks():
    ParallelPlan(ep=2).for_world(4).check_gradient_sync(fsdp=True)
    with pytest.raises(MeshError, match=r"ep=2 .*needs the fsdp pass"):
        ParallelPlan(ep=2).for_world(4).check_gradient_sync(fsdp=False)
    with pytest.raises(MeshError, match=r"pp=2 .* on 4 ranks leaves 2 data-parallel ranks"):
        ParallelPlan(pp=2).for_world(4).check_gradient_sync(fsdp=False)
    ParallelPlan(pp=2).for_world(2).check_gradient_sync(fsdp=False)  # one rank per stage


def test_an_ep_group_borrows_the_cp_ranks():
    """torchtitan's rule: EP splits the FSDP group (dp_shard x cp), so ep 2 x cp 2 runs on
    2 ranks (the ep group is the cp group) and on 4 (dp_shard 2)."""
    assert ParallelPlan(ep=2, cp=2).for_world(2).dp_shard == 1
    assert ParallelPlan(ep=4, cp=2).for_world(4).fsdp == 4


def test_pass_config_degrees_are_a_view_of_one_plan():
    config = PassConfig(fsdp_degree=4, tp_size=2, cp_degree=2)
    assert config.parallel == ParallelPlan(dp_shard=2, tp=2, cp=2)
    assert config.parallel.fsdp == config.fsdp_degree
    assert PassConfig(pp_degree=2).parallel.pp == 2
    assert PassConfig(ep_degree=2).parallel.ep == PassConfig(ep_degree=2).ep_degree == 2
    # One copy of each rule: PassConfig refuses what the plan refuses, with the plan's error.
    with pytest.raises(MeshError, match=r"ep=4 .*does not divide the 2 data-parallel ranks"):
        PassConfig(fsdp_degree=2, cp_degree=2, ep_degree=4)
    with pytest.raises(MeshError, match=r"PassConfig.fsdp_degree=3 with cp_degree=2"):
        PassConfig(fsdp_degree=3, cp_degree=2)


def test_axis_and_role_names_format_as_their_values():
    assert f"{Role.FSDP}" == "fsdp" and str(Role.EP_REPLICATE) == "ep_replicate"
    assert {Role.TP: 1}["tp"] == 1  # a role is the string the graph's roles are keyed by
    assert [r.value for r in Role] == ["fsdp", "replicate", "tp", "pp", "cp", "ep", "ep_replicate"]
    assert Axis.DP_SHARD == "fsdp_shard" and Axis.DP_REPLICATE == "fsdp_replicate"


def test_a_missing_role_names_the_role_and_the_roles_that_exist():
    error = MissingGroupError(Role.CP, (Role.FSDP, Role.TP))
    assert "no 'cp' process group; its roles are: 'fsdp', 'tp'" in str(error)
    assert isinstance(error, ConfigError) and error.role is Role.CP
    assert "its roles are: none" in str(MissingGroupError("tp", ()))


# ------------------------------------------------------------------ one owner of the layout


@pytest.mark.parametrize(
    "seeds",
    [
        {"fsdp_degree": None},
        {"fsdp_degree": 8, "cp_degree": 2, "tp_size": 2},
        {"fsdp_degree": 4, "pp_degree": 2, "pp_virtual_stages": 2, "ep_degree": 2},
    ],
)
def test_pass_config_seeds_are_read_and_written_back_by_the_plan(seeds):
    schedule = "interleaved_1f1b" if seeds.get("pp_virtual_stages", 1) > 1 else "1f1b"
    config = PassConfig(**seeds, pp_schedule=schedule)
    plan = config.parallel
    assert plan == ParallelPlan.from_seeds(**seeds)
    assert ParallelPlan.from_seeds(**plan.seeds()) == plan
    assert dataclasses.replace(config, **plan.seeds()) == config  # the same fields, unchanged
    # fsdp_degree counts the cp ranks; the plan's dp_shard does not.
    if seeds["fsdp_degree"] is not None:
        assert plan.fsdp == seeds["fsdp_degree"]
        assert plan.dp_shard == seeds["fsdp_degree"] // seeds.get("cp_degree", 1)
    with pytest.raises(MeshError, match=r"fsdp_degree=3 with cp_degree=2: .*multiple"):
        ParallelPlan.from_seeds(fsdp_degree=3, cp_degree=2)


def test_every_size_is_derived_by_the_plan():
    plan = ParallelPlan(
        dp_replicate=2, dp_shard=3, cp=2, tp=2, pp=2, pp_virtual_stages=2
    ).for_world(48)
    assert (plan.dp, plan.fsdp, plan.dp_cp, plan.stages) == (6, 6, 12, 4)
    unknown = ParallelPlan(cp=2, pp=3)
    assert (unknown.dp, unknown.fsdp, unknown.dp_cp, unknown.stages) == (None, None, None, 3)


def test_mesh_shapes_lay_out_one_rank_order():
    plan = ParallelPlan(dp_replicate=2, cp=2, tp=2, pp=2, ep=2).for_world(32)  # dp_shard 2
    assert plan.mesh_shape("device") == ((2, 4, 2, 2), ("pp", "dp", "cp", "tp"))
    assert plan.mesh_shape("fsdp") == (
        (2, 2, 4, 2),
        ("pp", "fsdp_replicate", "fsdp_shard", "tp"),
    )
    assert plan.mesh_shape("ep") == (
        (2, 2, 2, 2, 2),
        ("pp", "fsdp_replicate", "ep_replicate", "ep", "tp"),
    )
    flat = ParallelPlan().for_world(4)  # pp, the ep mesh's replicas: only above 1
    assert flat.mesh_shape("device") == ((4, 1, 1), ("dp", "cp", "tp"))
    assert flat.mesh_shape("fsdp") == ((1, 4, 1), ("fsdp_replicate", "fsdp_shard", "tp"))
    # Without unit dims: the trainer's own groups, (pp, fsdp_shard) and (pp, ep_replicate, ep).
    own = ParallelPlan(pp=2, ep=4).for_world(8)
    assert own.mesh_shape("fsdp", unit_dims=False) == ((2, 4), ("pp", "fsdp_shard"))
    assert own.mesh_shape("ep", unit_dims=False) == ((2, 1, 4), ("pp", "ep_replicate", "ep"))
    with pytest.raises(MeshError, match=r"no dp_shard yet: .*for_world"):
        ParallelPlan().mesh_shape("device")


def test_dp_rank_is_the_data_parallel_index_of_the_rank_order():
    """Rank ((((p * R + r) * S + s) * C + c) * T + t) reads data slice r * S + s."""
    plan = ParallelPlan(dp_replicate=2, dp_shard=3, cp=2, tp=2, pp=2)
    ranks = iter(range(plan.world_size))
    for _p in range(2):
        for r in range(2):
            for s in range(3):
                for _c in range(2):
                    for _t in range(2):
                        assert plan.dp_rank(next(ranks)) == r * 3 + s
    with pytest.raises(MeshError, match=r"no dp_shard yet"):
        ParallelPlan().dp_rank(0)
