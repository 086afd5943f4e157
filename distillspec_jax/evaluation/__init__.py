"""Measuring drafts: task quality and the evaluation rows, the examples each process reads,
the one wall-clock speed measurement, core pinning, the report and the lossy trade-off."""
