"""Leaf helpers every layer uses: errors, torch.distributed, dtypes, files, architecture numbers.
Imports nothing else of the package."""
