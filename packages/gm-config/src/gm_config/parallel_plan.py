"""``ParallelPlan``: every parallel degree of a run as one value, and every rule about them.

The plan is the one owner of the layout: it holds the degrees, validates them, derives every
size from them (:attr:`~ParallelPlan.dp`, :attr:`~ParallelPlan.fsdp`,
:attr:`~ParallelPlan.dp_cp`, :attr:`~ParallelPlan.stages`, ...) and lays the ranks out
(:meth:`~ParallelPlan.mesh_shape`, :meth:`~ParallelPlan.dp_rank`). Everything else reads it:

- ``PassConfig``'s degree fields (``fsdp_degree``, ``tp_size``, ``pp_degree``,
  ``pp_virtual_stages``, ``cp_degree``, ``ep_degree``) are the user's *inputs* to a plan, read
  in one way only, :meth:`ParallelPlan.from_seeds` (``PassConfig.parallel``), and written back
  by :meth:`ParallelPlan.seeds`;
- gm-train's ``parallel.*`` keys are those fields, its ``dist.dp_replicate`` the plan's
  ``dp_replicate`` (``JobConfig.parallel_plan``);
- ``gm_trainer.MeshContext`` adapts a device mesh to a plan (its ``parallel``), and the one
  mesh builder (``gm_trainer.parallel.mesh.build_mesh``) lays a plan out.

The rules about degrees (sizes, products, what divides what, which combinations run) are
written here once, so each error names the degrees and the sizes they may take. Rules that
need live objects (a mesh's groups, a model's expert count) stay with those objects and call
the plan.

:class:`Axis` names the device-mesh dims, :class:`Role` the process groups the graph passes
ask for; both are the only definition of those names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from gm_config.combinations import refused
from gm_config.errors import ConfigError, divisors


class _Name(str, Enum):
    """A name that formats as its value (``f"{Role.FSDP}"`` is ``"fsdp"``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Axis(_Name):
    """The dim names of the device meshes (``MeshContext.build`` lays them out)."""

    PP = "pp"
    DP = "dp"
    """Every data-parallel rank (``dp_replicate x dp_shard``) of ``device_mesh``."""
    DP_REPLICATE = "fsdp_replicate"
    DP_SHARD = "fsdp_shard"
    """The FSDP shard dim of ``fsdp_non_moe_mesh``: ``dp_shard x cp`` ranks."""
    CP = "cp"
    TP = "tp"
    EP_REPLICATE = "ep_replicate"
    EP = "ep"


class Role(_Name):
    """The process groups a run may have, by what the passes use them for."""

    FSDP = "fsdp"
    """The ranks parameters are sharded over and gradients reduce-scattered over
    (``dp_shard x cp``)."""
    REPLICATE = "replicate"
    """HSDP: the replicas of one shard, over which gradients are all-reduced."""
    TP = "tp"
    PP = "pp"
    """One rank per pipeline stage (the schedule's sends and receives, the loss broadcast)."""
    CP = "cp"
    EP = "ep"
    """The expert-parallel group (the all-to-alls)."""
    EP_REPLICATE = "ep_replicate"
    """The ranks holding the same experts: their gradients are reduced over it."""


class MeshError(ConfigError):
    """The parallel degrees, or the mesh that lays them out, describe no layout graph mode runs."""


#: How each degree is spelled elsewhere, for the errors.
_SPELLED = {
    "dp_replicate": ("MeshContext.build(dp_replicate=)", "gm-train dist.dp_replicate"),
    "dp_shard": ("PassConfig.fsdp_degree = dp_shard x cp", "MeshContext.build(dp_shard=)"),
    "tp": ("PassConfig.tp_size", "gm-train parallel.tp_size"),
    "pp": ("PassConfig.pp_degree", "gm-train parallel.pp_degree"),
    "pp_virtual_stages": ("PassConfig.pp_virtual_stages",),
    "cp": ("PassConfig.cp_degree", "gm-train parallel.cp_degree"),
    "ep": ("PassConfig.ep_degree", "gm-train parallel.ep_degree"),
}


#: ``PassConfig``'s field of each degree it seeds (``dp_shard`` is read from ``fsdp_degree``,
#: which counts the cp ranks too; ``dp_replicate`` has no field: a mesh or the job brings it).
SEED_FIELDS = {
    "tp": "tp_size",
    "pp": "pp_degree",
    "pp_virtual_stages": "pp_virtual_stages",
    "cp": "cp_degree",
    "ep": "ep_degree",
}

#: The device meshes :meth:`ParallelPlan.mesh_shape` lays out.
MeshName = Literal["device", "fsdp", "ep"]


def _spelled(field: str) -> str:
    return ", ".join(_SPELLED[field])


def _named(field: str, value: object, *, in_each: bool = False) -> str:
    """``ep=2 (PassConfig.ep_degree, gm-train parallel.ep_degree)``; ``in_each``: the value in
    every spelling a user may have written it in (``PassConfig.ep_degree=2, ...``)."""
    spellings = _SPELLED[field]
    if in_each:  # a key takes the value; a call (``build(ep=)``) or a formula does not
        spellings = tuple(
            s if s.endswith(")") or " = " in s else f"{s}={value!r}" for s in spellings
        )
    return f"{field}={value!r} ({', '.join(spellings)})"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelPlan:
    """The degrees of every parallel dimension of a run, validated on construction.

    Ranks are laid out as ``pp x dp_replicate x dp_shard x cp x tp`` (the last varies
    fastest): rank ``((((p * dp_replicate + r) * dp_shard + s) * cp + c) * tp + t``. FSDP
    shards over ``dp_shard x cp`` (:attr:`fsdp`), expert parallelism splits those ranks into
    groups of ``ep`` consecutive ones. :meth:`for_world` fills ``dp_shard`` from the world
    size; :meth:`from_seeds` reads ``PassConfig``'s degree fields.
    """

    dp_replicate: int = 1
    """HSDP replicas: copies of the model, each sharded over ``dp_shard x cp`` ranks, whose
    gradients are all-reduced across replicas."""

    dp_shard: int | None = None
    """Data-parallel ranks one replica shards over, *without* the ``cp`` ranks (which read the
    same data); the FSDP group with them is :attr:`fsdp`. ``None``: the ranks left over,
    filled in by :meth:`for_world`."""

    tp: int = 1
    """Tensor-parallel ranks (the model's TP layers or DTensor plan split each weight)."""

    pp: int = 1
    """Pipeline stages, one per group of ``world / pp`` ranks."""

    pp_virtual_stages: int = 1
    """Stages per pipeline rank (interleaved schedules): ``pp x pp_virtual_stages`` stages."""

    cp: int = 1
    """Context-parallel ranks: they split the sequence of every activation."""

    ep: int = 1
    """Expert-parallel ranks: the routed experts of each MoE layer are split over groups of this
    many ranks of a stage's FSDP group (``dp_shard x cp``: a cp rank routes its own tokens)."""

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_seeds(
        cls,
        *,
        fsdp_degree: int | None = None,
        tp_size: int = 1,
        pp_degree: int = 1,
        pp_virtual_stages: int = 1,
        cp_degree: int = 1,
        ep_degree: int = 1,
        dp_replicate: int = 1,
    ) -> ParallelPlan:
        """The plan ``PassConfig``'s degree fields describe (the one way they are read:
        ``PassConfig.parallel`` calls this). ``fsdp_degree`` is the FSDP group's size, which
        counts the cp ranks: ``dp_shard = fsdp_degree / cp_degree`` (``None``: left to
        :meth:`for_world` or a mesh); the other fields are the degrees :data:`SEED_FIELDS`
        names. :meth:`seeds` is the inverse."""
        shard, cp = fsdp_degree, cp_degree
        if _is_int(shard) and _is_int(cp) and shard >= 1 and cp >= 1:
            if shard % cp:
                raise MeshError(
                    f"PassConfig.fsdp_degree={shard} with cp_degree={cp}: the FSDP group spans "
                    "dp_shard x cp ranks, so fsdp_degree must be a multiple of cp_degree "
                    f"(e.g. {cp * max(1, shard // cp)}); or leave it None"
                )
            shard //= cp
        return cls(
            dp_replicate=dp_replicate,
            dp_shard=shard,
            tp=tp_size,
            pp=pp_degree,
            pp_virtual_stages=pp_virtual_stages,
            cp=cp,
            ep=ep_degree,
        )

    def seeds(self) -> dict[str, int | None]:
        """The ``PassConfig`` degree fields that describe this plan (:meth:`from_seeds`'
        inverse; ``dp_replicate`` has no field there)."""
        fields = {seed: getattr(self, degree) for degree, seed in SEED_FIELDS.items()}
        return {"fsdp_degree": self.fsdp, **fields}

    def validate(self) -> None:
        """Raise :class:`MeshError` (a ``ConfigError``) naming the first bad degree."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "dp_shard" and value is None:
                continue
            if not _is_int(value) or value < 1:
                hint = " or None (the ranks left over)" if field.name == "dp_shard" else ""
                raise MeshError(
                    f"{field.name} ({_spelled(field.name)}) must be an int >= 1{hint}, "
                    f"got {value!r}"
                )
        self._validate_combinations()
        # An ep group borrows ranks of the FSDP group (dp_shard x cp, torchtitan's rule):
        # routing is per token, so a cp rank exchanges its own tokens like a dp rank.
        if self.fsdp is not None and self.fsdp % self.ep:
            ranks = (
                f"{self.fsdp} data-parallel ranks of a stage ({_named('dp_shard', self.dp_shard)}"
            )
            ranks += f" x {_named('cp', self.cp)})" if self.cp > 1 else ")"
            raise MeshError(
                f"{_named('ep', self.ep)} does not divide the {ranks}; an ep group is made "
                f"of ep of them (choose ep among {divisors(self.fsdp)})"
            )

    def _validate_combinations(self) -> None:
        """The combinations no pass implements yet (the library's entries of
        :data:`gm_config.combinations.UNSUPPORTED`), each refused with the degrees named."""
        entry = refused(self.degrees())
        if entry is None:
            return
        first, *others = (_named(dim, getattr(self, dim), in_each=True) for dim in entry.dims)
        raise MeshError(
            f"{first} with {' and '.join(others)}: {entry.what} is not supported yet "
            "(docs/user-guide.md, Limitations); use 1 for one of them"
        )

    # ------------------------------------------------------------------ sizes

    # Each size is ``None`` until ``dp_shard`` is known (:meth:`for_world`).

    @property
    def fsdp(self) -> int | None:
        """Ranks of the FSDP group, *with* the cp ranks: ``dp_shard x cp`` (what
        ``PassConfig.fsdp_degree`` counts; :attr:`dp_shard` is the group without them)."""
        return None if self.dp_shard is None else self.dp_shard * self.cp

    @property
    def dp(self) -> int | None:
        """Ranks that read different data: ``dp_replicate x dp_shard``."""
        return None if self.dp_shard is None else self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int | None:
        """Ranks of one stage and one TP place: ``dp_replicate x dp_shard x cp``, the FSDP
        group and its HSDP replicas, over which a (non-expert) gradient is reduced."""
        return None if self.dp_shard is None else self.dp_replicate * self.fsdp

    @property
    def stages(self) -> int:
        """Pipeline stages the model is cut into: ``pp x pp_virtual_stages``."""
        return self.pp * self.pp_virtual_stages

    @property
    def world_size(self) -> int | None:
        """Ranks the plan lays out (``None`` until ``dp_shard`` is known)."""
        dp = self.dp
        return None if dp is None else self.pp * dp * self.cp * self.tp

    def degrees(self) -> dict[str, int | None]:
        """Every degree by field name (for reports, YAML and cache keys)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # ------------------------------------------------------------------ the rank layout

    def mesh_shape(
        self, mesh: MeshName, *, unit_dims: bool = True
    ) -> tuple[tuple[int, ...], tuple[Axis, ...]]:
        """The sizes and dim names of one device mesh over this plan's ranks, every mesh in
        the one rank order of the class docstring (so their groups coincide):

        - ``"device"``: ``(pp, dp, cp, tp)``;
        - ``"fsdp"``: ``(pp, dp_replicate, fsdp, tp)``, FSDP over ``dp_shard x cp``;
        - ``"ep"``: ``(pp, dp_replicate, fsdp / ep, ep, tp)``, each replica's FSDP ranks split
          into groups of ``ep`` consecutive ones.

        ``pp`` leads only when above 1, and so does the ep mesh's ``dp_replicate``;
        ``unit_dims=False`` leaves out every ``dp_replicate``, ``cp`` and ``tp`` dim of size 1
        too (fewer groups to make). Needs ``dp_shard`` (:meth:`for_world`)."""
        fsdp = self.fsdp
        if fsdp is None:
            raise MeshError("the plan has no dp_shard yet: lay it out on a world (for_world)")
        dims = {
            "device": ((Axis.PP, self.pp), (Axis.DP, self.dp), (Axis.CP, self.cp)),
            "fsdp": ((Axis.PP, self.pp), (Axis.DP_REPLICATE, self.dp_replicate)),
            "ep": ((Axis.PP, self.pp), (Axis.DP_REPLICATE, self.dp_replicate)),
        }[mesh]
        dims += {
            "device": (),
            "fsdp": ((Axis.DP_SHARD, fsdp),),
            "ep": ((Axis.EP_REPLICATE, fsdp // self.ep), (Axis.EP, self.ep)),
        }[mesh] + ((Axis.TP, self.tp),)
        optional = {Axis.PP, *((Axis.DP_REPLICATE,) if mesh == "ep" else ())}
        if not unit_dims:
            optional |= {Axis.DP_REPLICATE, Axis.CP, Axis.TP}
        kept = [(name, size) for name, size in dims if size > 1 or name not in optional]
        return tuple(size for _, size in kept), tuple(name for name, _ in kept)

    def dp_rank(self, rank: int) -> int:
        """Which of the :attr:`dp` data-parallel places global ``rank`` holds (which slice of
        each global batch it reads): ``replica x dp_shard + shard`` in the rank order of the
        class docstring; the cp and TP ranks of one place share it. Needs ``dp_shard``."""
        dp = self.dp
        if dp is None:
            raise MeshError("the plan has no dp_shard yet: lay it out on a world (for_world)")
        return (rank // (self.cp * self.tp)) % dp

    # ------------------------------------------------------------------ rules with the world

    def for_world(self, world_size: int) -> ParallelPlan:
        """This plan on ``world_size`` ranks: ``dp_shard`` filled with the ranks left over;
        raise :class:`MeshError` unless the degrees divide the world (naming the sizes each
        may take) and, when ``dp_shard`` is given, their product is the world size."""
        if not _is_int(world_size) or world_size < 1:
            raise MeshError(f"the world size must be an int >= 1, got {world_size!r}")
        left, before = world_size, []
        for name in ("pp", "tp", "cp", "dp_replicate"):
            degree = getattr(self, name)
            if left % degree:
                where = f"the world size {world_size}"
                if before:
                    where = f"the {left} ranks {world_size} / {' / '.join(before)} leaves"
                raise MeshError(
                    f"{_named(name, degree)} must divide {where}; choose {name} among "
                    f"{divisors(left)}"
                )
            left //= degree
            if degree > 1:
                before.append(f"{name} {degree}")
        if self.dp_shard is None:
            return dataclasses.replace(self, dp_shard=left)
        if self.dp_shard != left:
            product = " x ".join(
                f"{n}={getattr(self, n)}" for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp")
            )
            raise MeshError(
                f"{product} = {self.world_size}, but the world has {world_size} ranks; choose "
                f"degrees whose product is the world size: here dp_shard={left} "
                f"(PassConfig.fsdp_degree={left * self.cp}), or None to fill it in"
            )
        return self

    def taking(self, actual: ParallelPlan, where: str = "the mesh") -> ParallelPlan:
        """``actual`` (what ``where`` lays out) where this requested plan agrees with it:
        ``dp_shard=None`` and ``tp``/``cp``/``ep`` of 1 take its degrees, ``pp`` must be the
        same. Raise :class:`MeshError` naming both sizes otherwise."""
        if self.dp_shard is not None and self.fsdp != actual.fsdp:
            raise MeshError(
                f"PassConfig.fsdp_degree={self.fsdp} (dp_shard={self.dp_shard} x cp={self.cp}) "
                f"but the FSDP group of {where} has {actual.fsdp} ranks; leave fsdp_degree None "
                f"(taken from {where}) or set it to {actual.fsdp}"
            )
        for name in ("tp", "cp", "ep"):
            mine, theirs = getattr(self, name), getattr(actual, name)
            if mine not in (1, theirs):
                raise MeshError(
                    f"{_named(name, mine)} but {where} has {name}={theirs}; build it with "
                    f"MeshContext.build({name}={mine}, ...) or leave {name} 1 (taken from {where})"
                )
        if self.pp != actual.pp:
            raise MeshError(
                f"{_named('pp', self.pp)} but {where} has {actual.pp} pipeline stage(s); build "
                f"it with MeshContext.build(pp={self.pp}, ...) or set pp_degree={actual.pp}"
            )
        return dataclasses.replace(actual, pp_virtual_stages=self.pp_virtual_stages)

    def check_gradient_sync(self, fsdp: bool) -> None:
        """Raise :class:`MeshError` where only the fsdp pass would keep gradients in sync but
        ``fsdp`` (the pass) is off: expert parallelism, and a pipeline whose stages have several
        data-parallel ranks. Needs ``dp_shard`` (:meth:`for_world`)."""
        if fsdp:
            return
        if self.ep > 1:
            raise MeshError(
                f"{_named('ep', self.ep)} needs the fsdp pass (it reduces the experts' gradients "
                "over the ranks that hold the same experts); leave PassConfig.fsdp_enabled on"
            )
        dp = self.dp or 1
        if self.pp > 1 and dp > 1:
            raise MeshError(
                f"{_named('pp', self.pp)} on {self.world_size} ranks leaves {dp} data-parallel "
                "ranks per stage, but FSDP is off (PassConfig.fsdp_enabled or the plan), and "
                "only the fsdp pass keeps their gradients in sync; turn FSDP on or use "
                f"{self.world_size // dp} ranks"
            )


class MissingGroupError(ConfigError):
    """A pass asked for a process-group role the run does not have (never the world instead)."""

    def __init__(self, role: object, roles: tuple[object, ...], message: str = "") -> None:
        have = ", ".join(repr(str(r)) for r in roles) or "none (no parallel degree above 1)"
        super().__init__(
            message
            or f"the run has no {str(role)!r} process group; its roles are: {have}. Set the "
            "degree that makes it (ParallelPlan / PassConfig / MeshContext.build), or hand the "
            "passes the groups (PassPipeline.run(groups=ParallelGroups(...)))"
        )
        self.role, self.roles = role, roles
