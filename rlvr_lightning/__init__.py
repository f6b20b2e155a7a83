"""rlvr_lightning: reinforcement learning with verifiable rewards, every algorithm a LightningModule."""

__version__ = "0.1.0"
