"""Measuring drafts: task quality and the evaluation rows, the one wall-clock speed measurement, core pinning, the report and the lossy trade-off."""
