"""Layout variants the configuration sweep adds for MoE features (``sweep.feature_layouts``)."""
from __future__ import annotations


def expert_tp_layouts(layouts: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
    """The ``layouts`` with tp > 1 again with ``expert_tp`` = tp (MoE only: each expert's hidden
    split over tp instead of whole experts per tp rank), leaving out pp (stages add nothing to how
    an expert is split)."""
    return [(w, {**par, "expert_tp": par["tp"]}) for w, par in layouts
            if par.get("tp", 1) > 1 and par.get("pp", 1) == 1]


def hierarchical_layouts(layouts: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
    """The ``layouts`` with ep > 1 and neither tp nor pp again with ``moe_dispatch: hierarchical`` over
    1-rank nodes (``node_size`` 1: every ep rank its own node, so every hop but the local one crosses
    nodes); its rules (``ep.hier_rules``) exclude tp and the split pipeline schedules."""
    return [(w, {**par, "moe_dispatch": "hierarchical", "node_size": 1}) for w, par in layouts
            if par.get("ep", 1) > 1 and par.get("tp", 1) == 1 and par.get("pp", 1) == 1]
