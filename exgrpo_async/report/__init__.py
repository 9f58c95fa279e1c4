"""A run's report: its metrics read back, the held-out curve, and the Markdown report with its plots."""
