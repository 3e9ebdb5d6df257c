"""One training job around the recipe: preflight refusals, the run folder, resume, failures (stopping is
core/stopping.py)."""
