"""HF `generate` rollout engine: the explicit fallback (`--rollout.engine hf`).

It samples with the trainer's own module, so a weight sync has nothing to copy; it is several times
slower than vLLM (see bench/) and exists for models or platforms vLLM does not support.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import LogitsProcessor

from rlvr_lightning.rollout.engine import LogprobsFn
from rlvr_lightning.rollout.types import Completion, SamplingConfig, left_padded


def sharded_across_ranks(model: torch.nn.Module) -> bool:
    """Whether `model` is FSDP2-sharded over several ranks. Its every forward then all-gathers weights
    with the other ranks, so they must take the same number of decoding steps even when one rank's
    sequences all stop early (`generate(synced_gpus=True)`); otherwise the collectives fall out of step
    (a gloo error or a hang). transformers detects this only for models sharded by its own FSDP code."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) and dist.is_initialized() and dist.get_world_size() > 1


class ChosenTokenLogprobs(LogitsProcessor):
    """A logits processor, last in the list, that keeps only the log-probability of each sampled token.

    `generate(output_scores=True)` keeps every step's full-vocabulary scores until the end: sequences ×
    response tokens × vocabulary floats (18.5 GiB at 32 × 1,024 tokens and a 151,936-token vocabulary).
    Here one step's log-softmax is held until the next call, whose `input_ids` end with the token drawn
    from it; the last step's token is read from the finished sequences (`finish`)."""

    def __init__(self) -> None:
        self.columns: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None  # the latest step's log-softmax, its token not yet drawn

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:
            self.columns.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
            self.last = None  # freed before the next one is made: one [sequences, vocabulary] copy, not two
        self.last = scores.float().log_softmax(-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[sequences, new tokens] log-probs; `generate` may have run steps past the last token it kept."""
        n = new_tokens.shape[1]
        if len(self.columns) < n and self.last is not None:
            self.columns.append(self.last.gather(-1, new_tokens[:, len(self.columns) : len(self.columns) + 1]).squeeze(-1))
        self.last = None
        if n == 0:
            return new_tokens.new_zeros(new_tokens.shape, dtype=torch.float32)
        return torch.stack(self.columns[:n], 1)


class HFGenerateEngine:
    def __init__(self, model: torch.nn.Module, pad_id: int, eos_id: int, logprobs: LogprobsFn) -> None:
        self.model = model
        self.policy_logprobs = logprobs  # log-probs of one completion under `model` (models.forward.sequence_logprobs)
        self.pad_id = pad_id
        self.eos_id = eos_id

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        device = next(self.model.parameters()).device
        ids, attn = left_padded(prompt_ids, self.pad_id)
        width = ids.shape[1]
        greedy = sampling.temperature == 0
        # transformers' own warpers, in the order `generate` would add them, then the recorder, so it sees
        # the distribution the tokens are drawn from; `generate` itself is told to add none of its own.
        warpers = (
            []
            if greedy
            else [TemperatureLogitsWarper(sampling.temperature)]
            + ([TopKLogitsWarper(sampling.top_k)] if sampling.top_k > 0 else [])
            + ([TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1.0 else [])
        )
        recorder = ChosenTokenLogprobs()
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        was_training = self.model.training
        self.model.eval()
        try:
            sequences = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=attn.to(device),
                max_new_tokens=sampling.max_tokens,
                num_return_sequences=sampling.group_size,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_id,
                **(dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)),
                logits_processor=LogitsProcessorList([*warpers, recorder]),
                synced_gpus=sharded_across_ranks(self.model),
            )
        finally:
            self.model.train(was_training)
        new_tokens = sequences[:, width:]
        token_lp = recorder.finish(new_tokens).cpu()
        new_tokens = new_tokens.cpu()
        completions = [self._cut_at_eos(new_tokens[k], token_lp[k]) for k in range(len(new_tokens))]
        return [completions[i * sampling.group_size : (i + 1) * sampling.group_size] for i in range(len(prompt_ids))]

    def _cut_at_eos(self, tokens: torch.Tensor, lp: torch.Tensor) -> Completion:
        hits = (tokens == self.eos_id).nonzero()
        if len(hits):
            end = int(hits[0]) + 1
            return Completion(tokens[:end].tolist(), lp[:end].tolist(), "stop")
        return Completion(tokens.tolist(), lp.tolist(), "length")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        """Nothing to copy: this engine samples with the trainer's module itself."""

    def load_adapter(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict, version: int | None = None
    ) -> None:
        """Nothing to copy: the trainer's module samples with its adapter already in place."""

    def release_memory(self) -> None:
        """Nothing to free: the trainer's own module is the engine."""

    def logprobs(self, prompt_ids: list[int], completion_ids: list[int], agreement_tol: float = 1e-3) -> list[float]:
        return self.policy_logprobs(prompt_ids, completion_ids)

    def close(self) -> None:
        self.model = None
