"""Checkpoints: DCP save / load, sync or asynchronous, atomic keep-last-k, resume from the newest
usable one (``dcp``); the manifest of checksums that every reader verifies (``integrity``)."""
from ndtrain import _forward

__getattr__ = _forward("ndtrain.checkpoint", "ndtrain.checkpoint.dcp", {
    "complete_checkpoints", "latest_checkpoint", "usable_checkpoint", "require_verified",
    "CheckpointSaver", "CheckpointDamagedError", "save_checkpoint", "load_checkpoint", "load_tensors"})
