"""Export formats (`python -m wandistiller.export --format`): one module per format, each declaring
`FORMAT = ExportFormat(...)` (base.py)."""
