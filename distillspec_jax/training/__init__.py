"""The trainer and what it needs: optimisers, orbax checkpoints, the metrics log, the logical-axis mesh rules and multi-host helpers."""
