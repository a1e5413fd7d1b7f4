"""The processes a job runs in: the launcher, process groups and collectives, signals, the
rank-report protocol, and the one seam to PyTorch's private names."""
