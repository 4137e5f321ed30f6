"""ParallelDims: the layout's degrees, validated once, and the DeviceMesh built from them
(docs/architecture.md).

Axes, outer to inner: ``pp, dp_replicate, dp_shard, cp, tp`` (tp on the fastest link). Derived:
``dp`` = dp_replicate x dp_shard (the data a rank reads), ``dp_shard_cp`` (what ZeRO / FSDP shard
over), ``dp_cp`` (what loss and grad norm reduce over). Expert parallel (torchtitan's convention)
cuts the flattened dp_shard x cp block into chunks of ``ep`` ranks: ``ep`` (the all-to-all),
``edp`` (ranks holding the same experts), ``edp_shard`` (ZeRO's expert shards) and ``ep_bwd`` (a
second process group for backward all-to-alls, so DualPipeV's threaded pairs never share one).
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

    @classmethod
    def from_config(cls, p, world_size: int) -> ParallelDims:
        """Degrees from a ``ParallelConfig`` on ``world_size`` ranks (typed by name: config imports this
        module's users)."""
        if world_size < 1:
            raise ConfigError(f"world_size ({world_size}) must be >= 1")
        for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
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
        dims = cls(p.dp_replicate, dp_shard, p.cp, p.tp, p.pp, p.ep, world_size)
        dims.validate()
        return dims

    def validate(self) -> None:
        prod = self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
        if prod != self.world_size:
            raise ConfigError(f"pp*dp_replicate*dp_shard*cp*tp ({prod}) != world_size ({self.world_size})")
        check_ep_borrow(self.ep, self.dp_shard, self.cp)

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
        parts += [f"ep{self.ep}"] if self.ep > 1 else []  # borrowed from dp_shard x cp
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
        self.ep_device_mesh = None  # (pp, dp_replicate, edp_shard, ep, tp) view when ep > 1
        self._make_expert_groups(device_type)

    def _make_group(self, name: str) -> AxisGroup:
        size = getattr(self.dims, name) if name in AXES else _prod(self.dims, DERIVED[name])
        if self.device_mesh is None or size == 1:
            return AxisGroup(name, size, 0, None, self.stats)
        sub = self._flat[name] if name in DERIVED else self.device_mesh[name]
        return AxisGroup(name, size, sub.get_local_rank(), sub.get_group(), self.stats)

    def _make_expert_groups(self, device_type: str) -> None:
        """Add the ``ep``, ``edp`` and ``edp_shard`` groups."""
        d = self.dims
        if d.ep == 1:
            self._groups["ep"] = self._groups["ep_bwd"] = AxisGroup("ep", 1, 0, None, self.stats)
            dp_cp = self._groups["dp_cp"]
            self._groups["edp"] = AxisGroup("edp", dp_cp.size, dp_cp.rank, dp_cp.pg, self.stats)
            sc = self._groups["dp_shard_cp"]
            self._groups["edp_shard"] = AxisGroup("edp_shard", sc.size, sc.rank, sc.pg, self.stats)
            return
        from torch.distributed.device_mesh import init_device_mesh

        # Same linear rank order as the main mesh: dp_shard x cp flattened, split (outer, inner=ep).
        shape = (d.pp, d.dp_replicate, d.dp_shard * d.cp // d.ep, d.ep, d.tp)
        names = ("pp", "dp_replicate", "edp_shard", "ep", "tp")
        self.ep_device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        ep_mesh = self.ep_device_mesh["ep"]
        self._groups["ep"] = AxisGroup("ep", d.ep, ep_mesh.get_local_rank(), ep_mesh.get_group(), self.stats)
        self._groups["ep_bwd"] = self._twin(self._groups["ep"], self.ep_device_mesh.mesh.movedim(3, -1))
        n_shard = d.dp_shard * d.cp // d.ep
        sub = self.ep_device_mesh["edp_shard"] if n_shard > 1 else None
        self._groups["edp_shard"] = AxisGroup("edp_shard", n_shard, sub.get_local_rank() if sub else 0,
                                              sub.get_group() if sub else None, self.stats)
        edp_size = d.dp_replicate * d.dp_shard * d.cp // d.ep
        if edp_size == 1:
            self._groups["edp"] = AxisGroup("edp", 1, 0, None, self.stats)
        else:
            edp = self.ep_device_mesh[("dp_replicate", "edp_shard")]._flatten("edp")
            self._groups["edp"] = AxisGroup("edp", edp_size, edp.get_local_rank(), edp.get_group(), self.stats)

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
