"""Data parallel: bucketed gradient all-reduce overlapped with backward (DDP)."""
