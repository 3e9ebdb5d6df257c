"""One training job around the recipe: preflight refusals, the run folder, resume, stopping, failures."""
