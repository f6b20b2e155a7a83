"""Token attribution: the scores behind THR (thr.py, from θ_old's LM-head inputs and the LM head) and
OAR (oar.py, from extra forwards of the policy), and the weights they become. The advantage shapers that
apply them to the advantages are in `rlvr_lightning.shapers`."""
