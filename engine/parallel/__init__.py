"""Tensor parallelism: one process per rank, the scheduler on rank 0 only (see executor.py)."""
