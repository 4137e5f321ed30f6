"""Measuring ndtrain's own eager step on this machine, for the planner: per-op timings
(``measure``, ``measure_eager``, ``measure_ep``), predictions of the eager step's memory and time
per layout (``eager_time``, ``eager_axes``, ``eager_axes_time``) and their fit (``calibrate``).
The planner itself (``ndtrain.planner``) stays pure and never imports this package."""
