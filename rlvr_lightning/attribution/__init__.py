"""Token attribution as pure tensor math: THR (thr.py) and OAR (oar.py) token weights."""
