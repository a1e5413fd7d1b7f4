"""Knowing before queueing: the dry run (one rank of any world size, in one process, on fake
tensors), the per-rank memory it measures, and the layout planner built on both."""
