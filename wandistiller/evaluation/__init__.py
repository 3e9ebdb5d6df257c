"""The evaluation library: a run's student against its teacher from the same noise, prompts and sampler
(`evaluate.py`), the quality figures as the field measures them (`metrics.py`), the teacher | student grid
(`grids.py`), and the numbers added to the run's own loggers (`logged.py`). `python -m wandistiller.eval` is its
CLI; the end-of-run `evaluate` hook (recipe/hooks/evaluate.py) and `python -m wandistiller.quality` call it too."""
