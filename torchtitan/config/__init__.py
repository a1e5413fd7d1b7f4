"""The job's configuration: the registry of the rules a config must pass (rules.py) and the
per-section option checks (sections.py). Torch-free, so the launcher's pre-check can read it."""
