"""The training loop as an object: the Trainer (loop.py), the step it shares with the dry run
(step.py), what watches the step from outside (instruments.py), and how a run ends (summary.py)."""
