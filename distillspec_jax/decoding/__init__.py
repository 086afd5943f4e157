"""The engine: plain decoding (the baseline) and speculative decoding (draft proposes, target verifies), with their statistics (tau, alpha)."""
