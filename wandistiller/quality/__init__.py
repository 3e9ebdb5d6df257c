"""Student quality as the field measures it (metrics.py) and the comparison table (`python -m wandistiller.quality`)."""
