"""The job's configuration: the options (job_config.py), reading them from TOML and the command
line (manager.py), the registry of the rules a config must pass (rules.py, with the per-section
option checks in sections.py), and the checks a rank runs before any process group (preflight.py,
output_locations.py, memory_floor.py). Importing this package imports no torch, so the launcher's
pre-check (`python -m torchtitan.config.manager`) takes milliseconds."""
