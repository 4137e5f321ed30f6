"""Pipeline parallel: stages, schedules (GPipe, 1F1B, interleaved, ZB-H1), runtime, p2p."""
