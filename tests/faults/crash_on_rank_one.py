"""Imported through experimental.custom_import by a test: rank 1 fails as a bug would."""

import os

if os.environ.get("RANK") == "1":
    raise RuntimeError("deliberate failure on rank 1")
