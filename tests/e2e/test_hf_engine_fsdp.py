"""The HF fallback engine on an FSDP2-sharded policy (2 CPU ranks, gloo): every forward all-gathers
weights, so a rank whose sequences all stop early must keep stepping until the other rank is done.
Without `synced_gpus` the ranks' collectives fall out of step: gloo raises (measured) or, on other
backends, the job hangs (the test then fails on its timeout)."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from rlvr_lightning.rollout.types import SamplingConfig
from tests.support.two_ranks import run_two_ranks

MAX_TOKENS = 12


def _rank(rank: int, port: int, model_dir: str, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from rlvr_lightning.models.forward import sequence_logprobs
    from rlvr_lightning.parallel import shard_policy
    from rlvr_lightning.rollout.hf_engine import HFGenerateEngine, sharded_across_ranks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        shard_policy(model, init_device_mesh("cpu", (2,)))
        prompt = [[5, 6, 7, 8]]
        greedy = SamplingConfig(group_size=1, temperature=0.0, max_tokens=MAX_TOKENS)
        # Greedy decoding is the same on both ranks: probe it (no EOS can stop it), then make rank 0's EOS
        # its first token (it stops at once) and rank 1's a token it never produces (it runs to the limit).
        score = partial(sequence_logprobs, model)
        probe = HFGenerateEngine(model, pad_id=0, eos_id=-1, logprobs=score).generate(prompt, greedy)[0][0].token_ids
        unused = min(set(range(3, 300)) - set(probe))
        eos = probe[0] if rank == 0 else unused
        completion = HFGenerateEngine(model, pad_id=0, eos_id=eos, logprobs=score).generate(prompt, greedy)[0][0]
        out[rank] = (sharded_across_ranks(model), len(completion.token_ids), completion.finish_reason)
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e
def test_ranks_that_stop_early_keep_the_sharded_forwards_in_step(tiny_policy_dir):
    result = run_two_ranks(_rank, str(tiny_policy_dir), timeout_s=120)
    assert result[0] == (True, 1, "stop")  # stopped at its first token, then kept stepping for rank 1
    assert result[1] == (True, MAX_TOKENS, "length")
