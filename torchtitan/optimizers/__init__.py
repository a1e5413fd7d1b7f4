"""Optimizer algorithms beyond torch.optim's: Muon (muon.py), Adam/AdamW with bf16 moments
(low_precision_adamw.py) and the rounding they store state with (rounding.py). The trainer builds
them in trainer/optimizer.py."""
