"""Verifiable rewards."""

from rlvr_lightning.rewards.math import (
    MathVerifier,
    VerifierUnavailable,
    VerifyResult,
    boxed_answers,
    extract_boxed,
    extract_prediction,
    normalize_gold,
    other_boxed_answers,
    verify_answer,
)

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
