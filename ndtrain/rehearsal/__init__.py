"""Scale rehearsal: the real trainer stepped for each rank role of a layout at full size, on a fake
process group of the full world size and fake tensors, measured (docs/rehearsal.md).

``roles`` finds the distinct ranks, ``fake`` makes the world they run in (``routing`` its MoE
routed counts), ``measure`` takes one
step's memory and traffic, ``worker`` runs one rank per process, ``run`` a whole layout beside the
planner, ``report`` prints it, ``command`` is ``ndtrain rehearse``."""
