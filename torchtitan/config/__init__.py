"""The job's configuration: the options (job_config.py), reading them from TOML and the command
line (manager.py), options that have no effect in a job (unused_options.py), the registry of the
rules a config must pass (rules.py, with the per-section option checks in sections.py), and the
checks a rank runs before any process group (preflight.py, output_locations.py). The bottom layer:
no module here but preflight.py imports a feature's parallelism (docs/architecture.md, "Where each
rule lives"). Importing this package imports no torch, so the launcher's pre-check (`python -m
torchtitan.config.manager`) takes milliseconds."""
