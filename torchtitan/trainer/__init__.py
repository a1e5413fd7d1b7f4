"""The training loop as an object: the Trainer (loop.py), the step it shares with the dry run
(step.py), what watches the step from outside (instruments.py), how a run ends (summary.py), the
optimizers and LR schedules (optimizer.py, optimizer_options.py) and validation (validation.py)."""
