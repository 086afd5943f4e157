"""Input pipeline: SentencePiece vocabularies, the seqio tasks (registered on demand), and NumPy batches with T5X feature names."""
