"""Verifiable rewards."""

from rlvr_lightning.rewards.math import (
    MathVerifier,
    VerifyResult,
    extract_boxed,
    extract_prediction,
    normalize_gold,
    verify_answer,
)

__all__ = [
    "MathVerifier",
    "VerifyResult",
    "extract_boxed",
    "extract_prediction",
    "normalize_gold",
    "verify_answer",
]
