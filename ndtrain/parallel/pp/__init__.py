"""Pipeline parallel: stages, schedules (GPipe, 1F1B, interleaved, ZB-H1), runtime, p2p, and the
plain 1F1B reference executor (``reference``); file map in docs/pipeline_parallel.md."""
