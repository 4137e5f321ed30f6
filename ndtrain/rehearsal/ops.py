"""The operators one rehearsed step runs, counted by shape: a ``TorchDispatchMode`` beside the
memory tracker that sees every aten operator the real code dispatches (on fake tensors too).

Each operator is kept under a key (name, phase, kind, GEMM / attention dims, dtype) with its count,
FLOPs and bytes moved, so the step's thousands of calls fold into a few hundred rows that
``ndtrain.rehearsal.timing`` costs on a named accelerator.

* **FLOPs**: ``torch.utils.flop_counter``'s formulas (mm, addmm, bmm, baddbmm, the CUDA attention
  kernels), and this module's for the operators it lacks: ``_grouped_mm`` (2 M N K over the groups)
  and the CPU flash attention (2 B H Tq Tk (dqk + dv) forward, twice that backward: the counter's
  convention, the full Tq x Tk square; causal skipping is a timing matter).
* **Bytes**: the logical size of every tensor read (inputs) and written (outputs), once each; views
  and allocations (``empty``) move none.
* **Phase**: ``bwd`` inside the autograd engine, ``fwd`` with grad mode on, ``other`` (optimizer,
  gradient clipping, the step's bookkeeping) with it off.
* **Kinds**: ``gemm``, ``attention``, ``comm`` (c10d operators: costed from the counted bytes, not
  here), ``view`` (no bytes), ``memory`` (everything else: bound by HBM bandwidth).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

DEVICE = torch.ops.prim.device.default  # a tensor's device, dispatched for fake tensors
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm"}
CPU_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu": False,
                 "_scaled_dot_product_flash_attention_for_cpu_backward": True}
ATTENTION = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
             "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
             "_efficient_attention_backward", *CPU_ATTENTION}
NO_BYTES = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_local_scalar_dense",
            "lift_fresh", "set_", "resize_", "as_strided_", "record_stream", "_unsafe_view", "device",
            "_record_function_enter_new", "_record_function_exit"}


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _phase() -> str:
    if torch._C._current_graph_task_id() != -1:
        return "bwd"
    return "fwd" if torch.is_grad_enabled() else "other"


def gemm_dims(name: str, args) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a GEMM operator's product: ``bmm`` / ``baddbmm`` batch b; a grouped
    GEMM's groups stacked along m (2D x 3D: rows of every group; 2D x 2D with a 3D output, the
    weight gradient: contraction over every group's rows)."""
    if name in ("addmm", "baddbmm"):  # (bias / input, a, b)
        args = args[1:]
    a, b = args[0], args[1]
    if name in ("bmm", "baddbmm"):
        return a.shape[0], a.shape[1], b.shape[2], a.shape[2]
    if name == "_grouped_mm":
        if a.dim() == 2 and b.dim() == 3:
            return 1, a.shape[0], b.shape[2], a.shape[1]
        if a.dim() == 2 and b.dim() == 2:
            return 1, a.shape[0], b.shape[1], a.shape[1]
        return a.shape[0], a.shape[1], b.shape[-1], a.shape[-1]
    return 1, a.shape[0], b.shape[1], a.shape[1]


def attention_dims(name: str, args) -> tuple[int, int, int, int, int, int]:
    """(batch, heads, Tq, Tk, dqk, dv) of an attention operator (forward: q, k, v first; backward:
    grad_out, q, k, v)."""
    q, k, v = (args[1], args[2], args[3]) if "backward" in name else (args[0], args[1], args[2])
    return q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]


def _is_causal(name: str, args, kwargs) -> bool:
    if name in CPU_ATTENTION:  # (q, k, v, dropout_p, is_causal, ...) / backward: 4 tensors first
        i = 6 if CPU_ATTENTION[name] else 4
        return bool(kwargs.get("is_causal", args[i] if len(args) > i else False))
    return bool(kwargs.get("is_causal", False)) or any(a is True for a in args if isinstance(a, bool))


def op_flops(name: str, packet, args, kwargs, out) -> float:
    """FLOPs of one call (0 for operators without a formula: elementwise work is costed by bytes)."""
    if name == "_grouped_mm":
        bt, m, n, k = gemm_dims(name, args)
        return 2.0 * bt * m * n * k
    if name in CPU_ATTENTION:
        bt, h, tq, tk, dqk, dv = attention_dims(name, args)
        f = 2.0 * bt * h * tq * tk * (dqk + dv)
        return 2 * f if CPU_ATTENTION[name] else f
    fn = flop_registry.get(packet)
    return float(fn(*args, **kwargs, out_val=out)) if fn is not None else 0.0


def _kind(func, name: str) -> str:
    ns = func.namespace
    if ns in ("c10d", "_c10d_functional", "_dtensor"):
        return "comm"
    if name in GEMMS:
        return "gemm"
    if name in ATTENTION:
        return "attention"
    if func.is_view or name in NO_BYTES:
        return "view"
    return "memory"


class OpRecorder(TorchDispatchMode):
    """Counts every operator dispatched while active: ``rows()`` gives the folded table.
    ``fast_device``: ``prim.device`` counted by its known row (``_record``'s). ``active()``: the innermost recorder entered and not yet left (None: none), which
    ``rehearsal.replay`` adds replayed rows to (``snapshot`` / ``delta`` / ``add_rows``)."""

    _entered: list = []  # recorders inside their ``with``, innermost last
    # ``prim.device`` past the tree walks here and in ``measure``'s modes; False: the slow twin
    # (``replay.fast_paths(False)``)
    fast_device = True

    def __init__(self):
        super().__init__()
        self.table: dict[tuple, list] = {}

    @classmethod
    def active(cls) -> OpRecorder | None:
        return cls._entered[-1] if cls._entered else None

    def __enter__(self):
        out = super().__enter__()
        OpRecorder._entered.append(self)
        return out

    def __exit__(self, *exc):
        OpRecorder._entered.remove(self)
        return super().__exit__(*exc)

    def snapshot(self) -> dict[tuple, tuple]:
        """The table's rows now: {key: (count, flops, bytes)}."""
        return {k: tuple(v) for k, v in self.table.items()}

    def delta(self, before: dict[tuple, tuple]) -> dict[tuple, tuple]:
        """Rows counted since ``before`` (a ``snapshot``): {key: (count, flops, bytes) added}."""
        zero = (0, 0.0, 0)
        return {k: tuple(a - b for a, b in zip(v, before.get(k, zero))) for k, v in self.table.items()
                if tuple(v) != before.get(k, zero)}

    def add_rows(self, rows: dict[tuple, tuple]) -> None:
        """Add ``delta``-shaped rows, as if their operators had been dispatched again."""
        for k, (n, flops, nbytes) in rows.items():
            row = self.table.setdefault(k, [0, 0.0, 0])
            row[0] += n
            row[1] += flops
            row[2] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is DEVICE and OpRecorder.fast_device and len(args) == 1 and isinstance(args[0], torch.Tensor):
            # most operators of a fake step (C++ asking a fake tensor its device): ``_record``'s
            # row for it, without the tree walks; pinned to ``_record`` by tests/rehearsal/test_replay.py
            self._add(("device", _phase(), "view", (), str(args[0].dtype).replace("torch.", ""), False), 0.0, 0)
            return out
        try:
            self._record(func, args, kwargs, out)
        except Exception as e:  # noqa: BLE001 - a shape this counter does not know must not break the step
            self._add(("unrecorded:" + func.__name__, _phase(), "memory", (), "", repr(e)[:60]), 0.0, 0)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        name = func._overloadpacket.__name__
        kind = _kind(func, name)
        ins = _tensors((args, kwargs))
        dtype = str(ins[0].dtype).replace("torch.", "") if ins else ""
        if kind in ("view", "comm"):
            self._add((name, _phase(), kind, (), dtype, False), 0.0, 0)
            return
        nbytes = _nbytes(ins) + (0 if name.endswith("_") else _nbytes(_tensors(out)))
        if name.endswith("_"):  # in place: its first input is written back
            nbytes += _nbytes(ins[:1])
        dims: tuple = ()
        causal = False
        if kind == "gemm":
            dims = gemm_dims(name, args)
        elif kind == "attention":
            dims = attention_dims(name, args)
            causal = _is_causal(name, args, kwargs)
        flops = op_flops(name, func._overloadpacket, args, kwargs, out) if kind in ("gemm", "attention") else 0.0
        self._add((name, _phase(), kind, tuple(int(d) for d in dims), dtype, causal), flops, nbytes)

    def _add(self, key: tuple, flops: float, nbytes: int) -> None:
        row = self.table.setdefault(key, [0, 0.0, 0])
        row[0] += 1
        row[1] += flops
        row[2] += nbytes

    def rows(self) -> list[dict]:
        """One dict per (operator, phase, kind, dims, dtype, causal): ``count``, ``flops`` and
        ``bytes`` summed over its calls."""
        return [{"op": k[0], "phase": k[1], "kind": k[2], "dims": list(k[3]), "dtype": k[4],
                 "causal": k[5] if isinstance(k[5], bool) else False, "count": v[0], "flops": v[1],
                 "bytes": v[2]} for k, v in self.table.items()]
