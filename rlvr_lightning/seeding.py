"""Seeds derived from the run's seed (`data.seed`): the same across runs and resumes, different per step,
per stream (a generation round, a noise source) and per rank."""

from __future__ import annotations

import hashlib

import torch

# Streams that are not generation rounds sit far above any round count.
OAR_NOISE_STREAM = 100_000


def derived_seed(seed: int, step: int, stream: int = 0, rank: int = 0) -> int:
    """seed·1,000,003 + step·101 + stream·10,007 + rank (generation round k of a step is stream k)."""
    return seed * 1_000_003 + step * 101 + stream * 10_007 + rank


def keyed_uniform(key: tuple[int, ...], sequences: list[int], length: int) -> torch.Tensor:
    """[len(sequences), length] uniform draws in [0, 1), row i from a generator seeded by (key, sequences[i])
    alone: a sequence's draws do not depend on which other sequences are drawn with it (micro-batches,
    ranks), and position t is the t-th draw whatever `length` is. The seed is a BLAKE2 digest of the
    integers, the same in every process and Python version (unlike `hash`)."""
    rows = []
    for n in sequences:
        digest = hashlib.blake2b(repr(tuple(int(k) for k in (*key, n))).encode(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        rows.append(torch.rand(length, generator=generator))
    return torch.stack(rows) if rows else torch.empty(0, length)
