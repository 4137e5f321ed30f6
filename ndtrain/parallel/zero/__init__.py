"""Sharded data parallel: ZeRO-1/2 (optimizer state / gradient shards) and ZeRO-3 / FSDP / HSDP."""
