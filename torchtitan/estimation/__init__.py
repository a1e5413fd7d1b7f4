"""Knowing before queueing: the dry run (one rank of any world size, in one process, on fake
tensors), the per-rank memory it measures, the layout planner built on both, and the start-up
memory floor every rank checks (memory_floor.py, a rule of config/rules.py)."""
