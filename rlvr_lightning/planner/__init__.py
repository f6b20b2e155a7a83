"""Know before you rent: each rank's memory and the step time of a run, predicted from the real model
code on tensors without storage (`python -m rlvr_lightning.plan`, `make plan`), and the pre-flight check
`make train` runs with it."""
