"""What the training process runs on: process groups, devices, signals, and the torch compat seam."""
