"""Checkpoints of other frameworks: Hugging Face T5 1.1, T5X, and the one importer that detects the format."""
