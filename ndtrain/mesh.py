"""ParallelDims: the layout's degrees, validated once, and the DeviceMesh built from them
(docs/architecture.md).

Axes, outer to inner: ``pp, dp_replicate, dp_shard, cp, tp`` (tp on the fastest link). Derived:
``dp`` = dp_replicate x dp_shard (the data a rank reads), ``dp_shard_cp`` (what ZeRO / FSDP shard
over), ``dp_cp`` (what loss and grad norm reduce over). Expert parallel (torchtitan's convention)
cuts the flattened dp_shard x cp block into chunks of ``ep`` ranks: ``ep`` (the all-to-all),
``edp`` (ranks holding the same experts), ``edp_shard`` (ZeRO's expert shards) and ``ep_bwd`` (a
second process group for backward all-to-alls, so DualPipeV's threaded pairs never share one).
When ``ep`` does not fit in dp_shard x cp, or ``expert_tp`` is neither 1 nor tp, the expert mesh is
*folded* (MoE Parallel Folding, Liu et al. 2025, Megatron-Core): each pp stage's ranks, flattened
as (dp_replicate, dp_shard, cp, tp), are split as (edp, ep, expert_tp), expert_tp innermost, so ep
may span tp, cp and dp ranks (docs/moe.md, "The folded expert mesh").
All-ones dims need no process group. The mesh is passed down, never a global."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ndtrain.errors import ConfigError

if TYPE_CHECKING:
    import torch

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DERIVED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
           "dp_cp": ("dp_replicate", "dp_shard", "cp")}


def check_ep_borrow(ep: int, dp_shard: int, cp: int) -> None:
    """ep divides dp_shard x cp, the block it borrows its ranks from. Raises ConfigError naming the rule."""
    if (dp_shard * cp) % ep:
        raise ConfigError(f"dp_shard*cp ({dp_shard * cp}) is not divisible by ep ({ep})")


def expert_folded(ep: int, expert_tp: int, dp_shard: int, cp: int, tp: int) -> bool:
    """True when the expert mesh is folded over the whole stage (module docstring); False for the
    borrowed layout (ep a chunk of dp_shard x cp, experts whole or split over the attention tp)."""
    return (dp_shard * cp) % ep != 0 or expert_tp not in (1, tp)


def check_expert_mesh(ep: int, expert_tp: int, edp: int, pp: int, dp_replicate: int, dp_shard: int, cp: int,
                      tp: int) -> None:
    """The expert mesh's rules; raises ConfigError naming the one that failed. Borrowed layout: ep
    divides dp_shard x cp. Folded: ep * expert_tp divides the stage's ranks; edp (0: derived as
    world / (pp * ep * expert_tp)) equals that quotient and is a multiple of dp_replicate (each
    replica holds every expert once)."""
    if ep < 1 or expert_tp < 1 or edp < 0:
        raise ConfigError(f"parallel.ep ({ep}) and parallel.expert_tp ({expert_tp}) must be >= 1, "
                          f"parallel.edp ({edp}) >= 0")
    stage = dp_replicate * dp_shard * cp * tp
    if stage % (ep * expert_tp):
        raise ConfigError(f"ep*expert_tp ({ep * expert_tp}) does not divide the ranks of a pp stage "
                          f"(dp_replicate*dp_shard*cp*tp = {stage}): ep*expert_tp*edp*pp must equal world_size")
    derived = stage // (ep * expert_tp)
    if edp and edp != derived:
        raise ConfigError(f"parallel.edp ({edp}) != world_size / (pp*ep*expert_tp) ({stage * pp} / "
                          f"{pp * ep * expert_tp} = {derived}): ep*expert_tp*edp*pp must equal world_size")
    if expert_folded(ep, expert_tp, dp_shard, cp, tp) and derived % dp_replicate:
        raise ConfigError(f"the folded expert mesh's edp ({derived}) is not divisible by dp_replicate "
                          f"({dp_replicate}): each replica must hold every expert")


@dataclass
class AxisGroup:
    """A named process group plus its mesh's byte counters. ``pg`` None (size 1): ``comm``'s collectives
    return their input and count nothing. ``bwd``: a twin group (same ranks and counters) for backward
    collectives (``ep`` only); None: backward uses this group."""

    name: str
    size: int
    rank: int
    pg: object | None
    stats: dict[str, float] = field(default_factory=dict)
    bwd: AxisGroup | None = field(default=None, repr=False, compare=False)


@dataclass
class ParallelDims:
    """Validated degrees; ``world_size`` must equal the product of all axes (ep excluded). Raises
    ConfigError naming the rule, e.g. ``"world_size (6) is not divisible by pp*dp_replicate*cp*tp (4)"``.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    world_size: int = 1
    expert_tp: int = 1  # 1 or tp: the borrowed layout; anything else folds the expert mesh
    edp: int = 0  # expert data parallel degree as configured (0: derived); ``expert_dp`` reads it

    @classmethod
    def from_config(cls, p, world_size: int) -> ParallelDims:
        """Degrees from a ``ParallelConfig`` on ``world_size`` ranks (typed by name: config imports this
        module's users)."""
        if world_size < 1:
            raise ConfigError(f"world_size ({world_size}) must be >= 1")
        for name in ("dp_replicate", "cp", "tp", "pp", "ep", "expert_tp"):
            if getattr(p, name) < 1:
                raise ConfigError(f"parallel.{name} ({getattr(p, name)}) must be >= 1")
        fixed = p.pp * p.dp_replicate * p.cp * p.tp
        dp_shard = p.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(f"world_size ({world_size}) is not divisible by "
                                  f"pp*dp_replicate*cp*tp ({fixed})")
            dp_shard = world_size // fixed
        elif dp_shard < 1:
            raise ConfigError(f"parallel.dp_shard ({dp_shard}) must be >= 1 or -1")
        dims = cls(p.dp_replicate, dp_shard, p.cp, p.tp, p.pp, p.ep, world_size, p.expert_tp,
                   getattr(p, "edp", 0))
        dims.validate()
        return dims

    def validate(self) -> None:
        prod = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if prod != self.world_size:
            raise ConfigError(f"pp*dp_replicate*dp_shard*cp*tp ({prod}) != world_size ({self.world_size})")
        check_expert_mesh(self.ep, self.expert_tp, self.edp, self.pp, self.dp_replicate, self.dp_shard,
                          self.cp, self.tp)

    @property
    def folded(self) -> bool:
        """The expert mesh is folded over the stage (``expert_folded``)."""
        return expert_folded(self.ep, self.expert_tp, self.dp_shard, self.cp, self.tp)

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same expert weights: world / (pp * ep * expert_tp). In the borrowed
        layout with whole experts under tp this counts the tp replicas too (their gradient sum
        runs in autograd over tp, the ``edp`` group covers the rest)."""
        return self.world_size // (self.pp * self.ep * self.expert_tp)

    def expert_degrees(self) -> dict[str, int]:
        """The expert mesh, outer to inner within a stage: ``{"edp", "ep", "expert_tp"}``."""
        return {"edp": self.expert_dp, "ep": self.ep, "expert_tp": self.expert_tp}

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def __str__(self) -> str:
        parts = [f"{a}{getattr(self, a)}" for a in AXES if getattr(self, a) > 1]
        parts += [f"ep{self.ep}"] if self.ep > 1 else []  # borrowed from dp_shard x cp, or folded
        parts += [f"expert_tp{self.expert_tp}"] if self.folded and self.expert_tp > 1 else []
        return " x ".join(parts or ["single"]) + f" (world {self.world_size})"

    def build_mesh(self, device_type: str = "cpu") -> Mesh:
        """Build the DeviceMesh (needs an initialised process group when world_size > 1)."""
        return Mesh(self, device_type)


class Mesh:
    """The layout's DeviceMesh with named and derived axes. ``group(name)``: this rank's ``AxisGroup``;
    ``stats``: bytes sent per axis since ``reset_stats()``."""

    def __init__(self, dims: ParallelDims, device_type: str = "cpu"):
        import torch.distributed as dist  # torch only once a mesh is built: the rules above stay torch-free

        self.dims = dims
        self.stats: dict[str, float] = {}
        self.device_mesh = None
        self._flat = {}
        self._groups: dict[str, AxisGroup] = {}
        # A world-size-1 layout never touches the process group, so a single-process reference
        # model can live inside a multi-process job (the parity tests rely on this).
        distributed = dims.world_size > 1 and dist.is_available() and dist.is_initialized()
        if dims.world_size > 1 and not distributed:
            raise RuntimeError(f"layout {dims} needs {dims.world_size} processes; "
                               "init_process_group has not been called")
        if distributed and dims.world_size != dist.get_world_size():
            raise ConfigError(f"layout world_size ({dims.world_size}) != processes "
                              f"({dist.get_world_size()})")
        if distributed:
            from torch.distributed.device_mesh import init_device_mesh

            shape = tuple(getattr(dims, a) for a in AXES)
            self.device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
            # Keep the flattened sub-meshes: slicing them back out of the root mesh is deprecated.
            self._flat = {d: self.device_mesh[axes]._flatten(d) for d, axes in DERIVED.items()}
        for name in AXES + tuple(DERIVED):
            self._groups[name] = self._make_group(name)
        self.ep_device_mesh = None  # (pp, dp_replicate, edp_shard, ep, tp | expert_tp) when ep > 1 or folded
        self._make_expert_groups(device_type)

    def _make_group(self, name: str) -> AxisGroup:
        size = getattr(self.dims, name) if name in AXES else _prod(self.dims, DERIVED[name])
        if self.device_mesh is None or size == 1:
            return AxisGroup(name, size, 0, None, self.stats)
        sub = self._flat[name] if name in DERIVED else self.device_mesh[name]
        return AxisGroup(name, size, sub.get_local_rank(), sub.get_group(), self.stats)

    def _make_expert_groups(self, device_type: str) -> None:
        """Add the ``ep``, ``ep_bwd``, ``edp``, ``edp_shard`` and ``expert_tp`` groups."""
        d = self.dims
        self._groups["expert_tp"] = (self._groups["tp"] if not d.folded and d.expert_tp > 1
                                     else AxisGroup("expert_tp", 1, 0, None, self.stats))
        if d.ep == 1 and not d.folded:
            self._groups["ep"] = self._groups["ep_bwd"] = AxisGroup("ep", 1, 0, None, self.stats)
            dp_cp = self._groups["dp_cp"]
            self._groups["edp"] = AxisGroup("edp", dp_cp.size, dp_cp.rank, dp_cp.pg, self.stats)
            sc = self._groups["dp_shard_cp"]
            self._groups["edp_shard"] = AxisGroup("edp_shard", sc.size, sc.rank, sc.pg, self.stats)
            return
        from torch.distributed.device_mesh import init_device_mesh

        # Both layouts cut the same linear rank order. Borrowed: dp_shard x cp flattened, split
        # (outer, inner=ep), tp innermost. Folded: the stage's (dp_replicate, dp_shard, cp, tp)
        # flattened, split (edp, ep, expert_tp) with edp = (dp_replicate, edp_shard).
        if d.folded:
            n_shard, inner, inner_name = d.expert_dp // d.dp_replicate, d.expert_tp, "expert_tp"
        else:
            n_shard, inner, inner_name = d.dp_shard * d.cp // d.ep, d.tp, "tp"
        shape = (d.pp, d.dp_replicate, n_shard, d.ep, inner)
        names = ("pp", "dp_replicate", "edp_shard", "ep", inner_name)
        self.ep_device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        self._groups["ep"] = self._sub_group("ep", d.ep)
        if d.ep > 1:
            self._groups["ep_bwd"] = self._twin(self._groups["ep"], self.ep_device_mesh.mesh.movedim(3, -1))
        else:
            self._groups["ep_bwd"] = self._groups["ep"]
        if d.folded:
            self._groups["expert_tp"] = self._sub_group("expert_tp", d.expert_tp)
        self._groups["edp_shard"] = self._sub_group("edp_shard", n_shard)
        edp_size = d.dp_replicate * n_shard
        if edp_size == 1:
            self._groups["edp"] = AxisGroup("edp", 1, 0, None, self.stats)
        else:
            edp = self.ep_device_mesh[("dp_replicate", "edp_shard")]._flatten("edp")
            self._groups["edp"] = AxisGroup("edp", edp_size, edp.get_local_rank(), edp.get_group(), self.stats)

    def _sub_group(self, name: str, size: int) -> AxisGroup:
        """The ``name`` dim of the expert DeviceMesh as a counted group (size 1: no process group)."""
        if size == 1:
            return AxisGroup(name, 1, 0, None, self.stats)
        sub = self.ep_device_mesh[name]
        return AxisGroup(name, size, sub.get_local_rank(), sub.get_group(), self.stats)

    def _twin(self, group: AxisGroup, ranks: torch.Tensor) -> AxisGroup:
        """A second process group over ``ranks`` (global, the group's axis last), set as ``group.bwd``.
        Collective: every rank creates every twin in the same order (``new_group``)."""
        import torch.distributed as dist

        mine = None
        for row in ranks.reshape(-1, ranks.shape[-1]).tolist():
            pg = dist.new_group(row)
            if dist.get_rank() in row:
                mine = pg
        group.bwd = AxisGroup(group.name, group.size, group.rank, mine, self.stats)  # same name: same counter
        return group.bwd

    def group(self, name: str) -> AxisGroup:
        return self._groups[name]

    def reset_stats(self) -> dict[str, float]:
        """Return and zero the per-axis byte counters."""
        out = dict(self.stats)
        self.stats.clear()
        return out

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if self.device_mesh is not None else 0


def _prod(dims: ParallelDims, axes: tuple[str, ...]) -> int:
    out = 1
    for a in axes:
        out *= getattr(dims, a)
    return out


def device_for_rank(local_rank: int, requested: str = "auto") -> torch.device:
    import torch

    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("training.device=cuda but no CUDA device is available")
    return torch.device("cuda", local_rank % torch.cuda.device_count())
