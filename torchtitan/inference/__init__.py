"""Generation from a trained checkpoint."""
