"""``MeshContext``: an external device mesh for TP + FSDP.

The upper layer (the automodel path) builds the mesh, creates the tensor-parallel groups and
bakes the TP collectives into the model's forward. Graph mode then only adds the FSDP
dimension: it shards over the ``fsdp_shard`` dim of ``fsdp_non_moe_mesh`` (or the ``dp`` dim of
``device_mesh``), never over the whole world — that would also shard along TP.

Two meshes over the same ranks, in the same rank order::

    device_mesh        ("dp", "cp", "tp")                        (dp_replicate * dp_shard, cp, tp)
    fsdp_non_moe_mesh  ("fsdp_replicate", "fsdp_shard", "tp")    (dp_replicate, dp_shard * cp, tp)

(sizes in terms of :meth:`MeshContext.build`'s arguments). With pipeline parallelism both
meshes lead with a ``"pp"`` dim: the ranks of one stage are one ``(dp, cp, tp)`` block.

``GraphTrainer`` accepts any object with ``device_mesh`` and ``fsdp_non_moe_mesh`` attributes
(duck typing); :func:`resolve_mesh_context` reads only those two, plus ``sequence_parallel`` and
``loss_parallel`` when present.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gm_config import ConfigError, PassConfig
from gm_config.combinations import CP_PP, EP_CP, EP_HSDP
from gm_trace.graph.groups import register_process_group
from gm_trainer.parallel.device import detect_device_type
from gm_trainer.parallel.tp import TP_GROUP_NAME

#: Registered name of the HSDP replicate group (the FSDP pass's ``"fsdp_replicate"`` role).
REPLICATE_GROUP_NAME = "fsdp_replicate"


class MeshError(ConfigError):
    """The mesh context does not describe a layout graph mode can shard over."""


@dataclass
class MeshContext:
    """The device meshes and parallel sizes of a TP + FSDP job, as the upper layer keeps them.

    Build one with :meth:`build`, or pass your own object with the same attributes.
    ``dp_shard_size`` counts the ranks one FSDP shard group spans (it includes ``cp``), so
    ``dp_replicate_size * dp_shard_size == dp_size * cp_size``.
    """

    device_mesh: Any = None
    """``DeviceMesh`` with dims ``("dp", "cp", "tp")``."""

    fsdp_non_moe_mesh: Any = None
    """``DeviceMesh`` with dims ``("fsdp_replicate", "fsdp_shard", "tp")`` over the same ranks;
    graph mode shards over ``fsdp_shard`` and all-reduces over ``fsdp_replicate``."""

    dp_size: int = 1
    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    dp_rank: int = 0
    """This rank's data-parallel index: which slice of the global batch it reads."""
    tp_rank: int = 0
    cp_rank: int = 0
    pp_size: int = 1
    """Pipeline stages (``PassConfig.pp_degree``); both meshes then lead with a ``"pp"`` dim."""
    pp_rank: int = 0
    """This rank's pipeline stage."""
    sequence_parallel: bool = False
    loss_parallel: bool = False
    # --- expert parallelism (issue 27) ---
    moe_mesh: Any = None
    """``DeviceMesh`` with dims ``("ep_replicate", "ep", "tp")`` (led by ``"pp"`` with
    pipelines) when ``ep > 1``: the FSDP shard dim split into groups of ``ep`` consecutive
    ranks, each holding every expert once, so ``ep_replicate x ep == dp_shard_size``."""
    ep_size: int = 1
    """Expert-parallel ranks (``PassConfig.ep_degree``)."""
    ep_rank: int = 0

    @classmethod
    def build(
        cls,
        *,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        tp: int = 1,
        cp: int = 1,
        pp: int = 1,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        device_type: str | None = None,
        ep: int = 1,
    ) -> MeshContext:
        """Both meshes over the world with ``torch.distributed.device_mesh.init_device_mesh``.

        ``dp_shard=-1`` takes the ranks left over: ``world // (dp_replicate * tp * cp)``.
        A collective (every rank must call it, with the same sizes). Registers the TP group as
        ``"tp"``, the name the layers of :mod:`gm_trainer.parallel.tp` use.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "MeshContext.build needs torch.distributed initialised first "
                "(gm_trainer.init_distributed() under torchrun)"
            )
        world = dist.get_world_size()
        sizes = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "cp": cp, "pp": pp}
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or not (size >= 1 or size == -1):
                raise MeshError(f"{name} must be a positive int (or -1 for dp_shard), got {size!r}")
        if -1 in (dp_replicate, tp, cp, pp):
            raise MeshError("only dp_shard may be -1 (take the ranks left over)")
        if dp_shard == -1:
            dp_shard = world // (dp_replicate * tp * cp * pp)
        if pp * dp_replicate * dp_shard * tp * cp != world:
            raise MeshError(
                f"pp={pp} x dp_replicate={dp_replicate} x dp_shard={dp_shard} x tp={tp} x "
                f"cp={cp} = {pp * dp_replicate * dp_shard * tp * cp}, but the world has {world} "
                "ranks; choose sizes whose product is the world size (dp_shard=-1 fills in "
                "the rest)"
            )
        device_type = device_type or detect_device_type()
        dp = dp_replicate * dp_shard
        # Rank = ((replicate * dp_shard + shard) * cp + c) * tp + t in both meshes, so their TP
        # groups coincide and FSDP shards over (dp_shard x cp), like torchtitan's dp_shard_cp.
        lead = ((pp,), ("pp",)) if pp > 1 else ((), ())
        device_mesh = init_device_mesh(
            device_type, (*lead[0], dp, cp, tp), mesh_dim_names=(*lead[1], "dp", "cp", "tp")
        )
        fsdp_mesh = init_device_mesh(
            device_type,
            (*lead[0], dp_replicate, dp_shard * cp, tp),
            mesh_dim_names=(*lead[1], "fsdp_replicate", "fsdp_shard", "tp"),
        )
        register_process_group(TP_GROUP_NAME, device_mesh["tp"].get_group())
        if ep != 1 and cp != 1:
            raise MeshError(f"ep={ep} with cp={cp}: {EP_CP.what} is not supported yet; use cp=1")
        moe_mesh = _moe_mesh(device_type, lead, dp_replicate, dp_shard * cp, tp, ep)
        return cls(
            device_mesh=device_mesh,
            fsdp_non_moe_mesh=fsdp_mesh,
            dp_size=dp,
            dp_replicate_size=dp_replicate,
            dp_shard_size=dp_shard * cp,
            tp_size=tp,
            cp_size=cp,
            dp_rank=device_mesh.get_local_rank("dp"),
            tp_rank=device_mesh.get_local_rank("tp"),
            cp_rank=device_mesh.get_local_rank("cp"),
            pp_size=pp,
            pp_rank=device_mesh.get_local_rank("pp") if pp > 1 else 0,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            moe_mesh=moe_mesh,
            ep_size=ep,
            ep_rank=moe_mesh.get_local_rank("ep") if moe_mesh is not None else 0,
        )


def _moe_mesh(
    device_type: str,
    lead: tuple[tuple[int, ...], tuple[str, ...]],
    dp_replicate: int,
    shard: int,
    tp: int,
    ep: int,
) -> Any:
    """The expert-parallel mesh over the same rank order (``None`` for ``ep == 1``)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise MeshError(f"ep must be a positive int, got {ep!r}")
    if ep == 1:
        return None
    if shard % ep:
        raise MeshError(
            f"ep={ep} does not divide the {shard} ranks of the FSDP shard dim (dp_shard x cp); "
            "an ep group is made of ep of them"
        )
    if dp_replicate > 1:
        raise MeshError(
            f"ep={ep} with dp_replicate={dp_replicate}: {EP_HSDP.what} is not supported yet; "
            "use dp_replicate=1"
        )
    return init_device_mesh(
        device_type,
        (*lead[0], shard // ep, ep, tp),
        mesh_dim_names=(*lead[1], "ep_replicate", "ep", "tp"),
    )


@dataclass(frozen=True)
class ResolvedMesh:
    """The process groups ``GraphTrainer`` takes from a mesh context (this rank's view)."""

    fsdp_group: dist.ProcessGroup
    """The FSDP shard group (``fsdp_shard`` or ``dp``), registered as ``"fsdp"``."""
    replicate_group: dist.ProcessGroup | None
    """The HSDP replicate group, when it has more than one rank."""
    tp_group: dist.ProcessGroup | None
    """The tensor-parallel group, when it has more than one rank."""
    fsdp_dim: str
    shard_tp_mesh: Any = None
    """The 2-D ``(fsdp_dim, "tp")`` sub-mesh, when there is a TP group: checkpoints lay
    TP x FSDP pieces out on it."""
    sequence_parallel: bool = False
    loss_parallel: bool = False
    pp_group: dist.ProcessGroup | None = None
    """The pipeline group (one rank per stage), when the mesh has a ``"pp"`` dim of more than
    one rank."""
    # --- expert parallelism (issue 27) ---
    ep_group: dist.ProcessGroup | None = None
    """The expert-parallel group (the mesh context's ``moe_mesh["ep"]``), when there is one."""
    ep_replicate_group: dist.ProcessGroup | None = None
    """The ranks holding the same experts (``moe_mesh["ep_replicate"]``)."""
    ep_mesh: Any = None
    """``moe_mesh["ep_replicate", "ep"]``: the mesh of those two groups."""
    # --- context parallelism (issue 29) ---
    cp_group: dist.ProcessGroup | None = None
    """The context-parallel group (the ranks that split one sequence), when the device mesh
    has a ``"cp"`` dim of more than one rank. The FSDP group spans it (``dp_shard x cp``)."""

    @property
    def cp_size(self) -> int:
        return self.cp_group.size() if self.cp_group is not None else 1

    @property
    def fsdp_size(self) -> int:
        return self.fsdp_group.size()

    @property
    def replicate_size(self) -> int:
        return self.replicate_group.size() if self.replicate_group is not None else 1

    @property
    def tp_size(self) -> int:
        return self.tp_group.size() if self.tp_group is not None else 1

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: different slices of the global batch."""
        return self.fsdp_size * self.replicate_size

    def checked_config(self, config: PassConfig) -> dict[str, Any]:
        """The ``PassConfig`` fields this mesh fills in; raise where ``config`` disagrees.

        ``fsdp_degree=None`` and ``tp_size=1`` take the mesh's sizes; ``sequence_parallel`` and
        ``loss_parallel`` (informational) take the mesh context's when the config leaves them
        False.
        """
        if config.fsdp_degree is not None and config.fsdp_degree != self.fsdp_size:
            raise MeshError(
                f"PassConfig.fsdp_degree={config.fsdp_degree} but the mesh's {self.fsdp_dim!r} "
                f"dim has {self.fsdp_size} ranks; leave fsdp_degree None (taken from the mesh) "
                f"or set it to {self.fsdp_size}"
            )
        if config.tp_size not in (1, self.tp_size):
            raise MeshError(
                f"PassConfig.tp_size={config.tp_size} but the mesh's 'tp' dim has {self.tp_size} "
                f"ranks; leave tp_size 1 (taken from the mesh) or set it to {self.tp_size}"
            )
        pp = self.pp_group.size() if self.pp_group is not None else 1
        if config.pp_degree != pp:
            raise MeshError(
                f"PassConfig.pp_degree={config.pp_degree} but the mesh has {pp} pipeline "
                f"stage(s) (its 'pp' dim); build the mesh with MeshContext.build(pp="
                f"{config.pp_degree}, ...) or set pp_degree={pp}"
            )
        ep = self.ep_group.size() if self.ep_group is not None else 1
        if config.ep_degree not in (1, ep):
            raise MeshError(
                f"PassConfig.ep_degree={config.ep_degree} but the mesh has ep={ep}; build the "
                f"mesh with MeshContext.build(ep={config.ep_degree}, ...) or leave ep_degree 1 "
                "(taken from the mesh)"
            )
        filled: dict[str, Any] = {"fsdp_degree": self.fsdp_size, "tp_size": self.tp_size}
        filled.update(self._checked_cp(config, pp))
        for field in ("sequence_parallel", "loss_parallel"):
            mesh_value = getattr(self, field)
            if getattr(config, field) and not mesh_value:
                raise MeshError(
                    f"PassConfig.{field}=True but the mesh context has {field}=False; the TP "
                    "layers of the model decide it, so set both alike"
                )
            filled[field] = mesh_value
        if (filled["sequence_parallel"] or filled["loss_parallel"]) and self.tp_size == 1:
            raise MeshError(
                "sequence_parallel / loss_parallel need a 'tp' dim of more than one rank; the "
                "mesh has none"
            )
        return filled

    def _checked_cp(self, config: PassConfig, pp: int) -> dict[str, Any]:
        """Context parallelism (issue 29): ``cp_degree`` 1 takes the mesh's ``cp`` dim."""
        if config.cp_degree not in (1, self.cp_size):
            raise MeshError(
                f"PassConfig.cp_degree={config.cp_degree} but the mesh's 'cp' dim has "
                f"{self.cp_size} rank(s); build the mesh with MeshContext.build(cp="
                f"{config.cp_degree}, ...) or leave cp_degree 1 (taken from the mesh)"
            )
        if self.cp_size > 1 and pp > 1:
            raise MeshError(
                f"cp={self.cp_size} with pp={pp}: {CP_PP.what} is not supported yet; build the "
                "mesh with cp=1 or pp=1"
            )
        return {"cp_degree": self.cp_size}


def _dim_names(mesh: Any) -> tuple[str, ...]:
    return tuple(getattr(mesh, "mesh_dim_names", None) or ())


def _ranks(mesh: Any, dim: str) -> tuple[dist.ProcessGroup, list[int]]:
    group = mesh[dim].get_group()
    return group, dist.get_process_group_ranks(group)


def resolve_mesh_context(mesh_context: Any) -> ResolvedMesh:
    """Pick this rank's FSDP, HSDP-replicate and TP groups from ``mesh_context``.

    Uses ``fsdp_non_moe_mesh`` (falling back to ``device_mesh``): its ``fsdp_shard`` dim, or
    ``dp`` when there is none, is the FSDP group; ``fsdp_replicate`` the replicate group.
    Checks that ``device_mesh["tp"]`` and ``fsdp_non_moe_mesh["tp"]`` hold the same ranks.
    Local: no collective is issued.
    """
    device_mesh = getattr(mesh_context, "device_mesh", None)
    fsdp_mesh = getattr(mesh_context, "fsdp_non_moe_mesh", None) or device_mesh
    if fsdp_mesh is None:
        raise MeshError(
            f"mesh_context ({type(mesh_context).__name__}) has neither a fsdp_non_moe_mesh nor "
            "a device_mesh; build one with gm_trainer.MeshContext.build(tp=..., dp_shard=...)"
        )
    where = "fsdp_non_moe_mesh" if fsdp_mesh is not device_mesh else "device_mesh"
    names = _dim_names(fsdp_mesh)
    fsdp_dim = next((d for d in ("fsdp_shard", "dp") if d in names), None)
    if fsdp_dim is None:
        raise MeshError(
            f"mesh_context.{where} has dims {names}; graph mode shards over its 'fsdp_shard' "
            "dim (or the 'dp' dim of device_mesh) and has neither — name the data-parallel "
            "shard dim 'fsdp_shard' (MeshContext.build does)"
        )
    cp_group = None
    if device_mesh is not None and "cp" in _dim_names(device_mesh):
        group, ranks = _ranks(device_mesh, "cp")
        cp_group = group if len(ranks) > 1 else None
    fsdp_group, _ = _ranks(fsdp_mesh, fsdp_dim)
    replicate_group = None
    if fsdp_dim == "fsdp_shard" and "fsdp_replicate" in names:
        group, ranks = _ranks(fsdp_mesh, "fsdp_replicate")
        replicate_group = group if len(ranks) > 1 else None
    tp_group = _tp_group(device_mesh, fsdp_mesh)
    pp_group = None
    if "pp" in names:
        group, ranks = _ranks(fsdp_mesh, "pp")
        pp_group = group if len(ranks) > 1 else None
    ep_group = ep_replicate_group = ep_mesh = None
    moe_mesh = getattr(mesh_context, "moe_mesh", None)
    if moe_mesh is not None and moe_mesh["ep"].size() > 1:
        ep_group, ep_replicate_group = (
            moe_mesh["ep"].get_group(),
            moe_mesh["ep_replicate"].get_group(),
        )
        ep_mesh = moe_mesh["ep_replicate", "ep"]  # slicing reuses the groups: no collective
    return ResolvedMesh(
        ep_group=ep_group,
        ep_replicate_group=ep_replicate_group,
        ep_mesh=ep_mesh,
        fsdp_group=fsdp_group,
        replicate_group=replicate_group,
        tp_group=tp_group,
        fsdp_dim=fsdp_dim,
        # Slicing reuses the mesh's groups: local, no collective.
        shard_tp_mesh=fsdp_mesh[fsdp_dim, "tp"] if tp_group and "tp" in names else None,
        sequence_parallel=bool(getattr(mesh_context, "sequence_parallel", False)),
        loss_parallel=bool(getattr(mesh_context, "loss_parallel", False)),
        pp_group=pp_group,
        cp_group=cp_group,
    )


def _tp_group(device_mesh: Any, fsdp_mesh: Any) -> dist.ProcessGroup | None:
    """The TP group; both meshes must agree on its ranks (the FSDP group must not span TP)."""
    found = {
        label: _ranks(mesh, "tp")
        for label, mesh in (("device_mesh", device_mesh), ("fsdp_non_moe_mesh", fsdp_mesh))
        if mesh is not None and "tp" in _dim_names(mesh)
    }
    if len(found) == 2 and fsdp_mesh is not device_mesh:
        (_, device_ranks), (_, fsdp_ranks) = found["device_mesh"], found["fsdp_non_moe_mesh"]
        if device_ranks != fsdp_ranks:
            raise MeshError(
                f"rank {dist.get_rank()}: device_mesh['tp'] holds ranks {device_ranks} but "
                f"fsdp_non_moe_mesh['tp'] holds ranks {fsdp_ranks}; both meshes must lay out "
                "the TP groups alike (build them over the same rank order)"
            )
    if not found:
        return None
    group, ranks = next(iter(found.values()))
    return group if len(ranks) > 1 else None
