"""Advantage shapers, the stages that reweight token advantages before the update: THR (thr.py) and OAR (oar.py),
configured by the module's `shapers` section (settings.py) and built with the training step (build.py)."""
