"""Verifiable rewards."""

from rlvr_lightning.rewards.extraction import (
    boxed_answers,
    extract_boxed,
    extract_prediction,
    normalize_gold,
    other_boxed_answers,
)
from rlvr_lightning.rewards.pool import MathVerifier, VerifierUnavailable, VerifyResult
from rlvr_lightning.rewards.verification import verify_answer

__all__ = [
    "MathVerifier",
    "VerifierUnavailable",
    "VerifyResult",
    "boxed_answers",
    "extract_boxed",
    "extract_prediction",
    "normalize_gold",
    "other_boxed_answers",
    "verify_answer",
]
