"""Seeds derived from the run's seed (`data.seed`): the same across runs and resumes, different per step,
per stream (a generation round, a noise source) and per rank."""

from __future__ import annotations

# Streams that are not generation rounds sit far above any round count.
OAR_NOISE_STREAM = 100_000


def derived_seed(seed: int, step: int, stream: int = 0, rank: int = 0) -> int:
    """seed·1,000,003 + step·101 + stream·10,007 + rank (generation round k of a step is stream k)."""
    return seed * 1_000_003 + step * 101 + stream * 10_007 + rank
