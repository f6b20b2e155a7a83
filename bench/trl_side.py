"""TRL's `GRPOTrainer` on the benchmarks' shared workload: the embedded warm-started policy and prompts, rewards from
our math-verify pool, one update per step (on-policy), clip 0.2, std-scaled group advantages, seq-mean-token-mean
loss (`loss_type="grpo"`, our `grpo` preset). Needs the `bench` extra (`pip install -e .[bench]`)."""

from __future__ import annotations

import tempfile
import time


def trl_grpo_steps(steps: int, *, prompts: int, group_size: int, max_tokens: int, lr: float, kl_beta: float,
                   use_vllm: bool, peft_config=None) -> dict:  # fmt: skip
    """Runs `steps` + 1 TRL steps; returns the seconds of each step after the first (warm-up) and the policy's
    trainable and total parameter counts (after PEFT wrapped it, when `peft_config` is given)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlvr_lightning.data.sources import embedded_records
    from rlvr_lightning.models.warm_start import embedded_policy_path
    from rlvr_lightning.rewards.pool import MathVerifier

    path = str(embedded_policy_path())
    records = embedded_records("train")[: prompts * (steps + 1)]
    data = datasets.Dataset.from_dict({"prompt": [r.problem for r in records], "answer": [r.answer for r in records]})
    verifier = MathVerifier(num_workers=2, timeout_s=5.0)

    def correctness(completions, answer, **_):
        return verifier.verify(list(answer), list(completions)).rewards

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds, self._t0 = [], 0.0

        def on_step_begin(self, *_, **__):
            self._t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self._t0)

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=prompts * group_size, gradient_accumulation_steps=1,
            num_generations=group_size, max_completion_length=max_tokens, temperature=1.0, learning_rate=lr,
            lr_scheduler_type="constant", beta=kl_beta, epsilon=0.2, num_iterations=1, loss_type="grpo",
            scale_rewards="group", max_grad_norm=1.0, max_steps=steps + 1, logging_steps=1, report_to="none",
            save_strategy="no", use_cpu=True, seed=0, shuffle_dataset=False, dataloader_num_workers=0,
            use_vllm=use_vllm, vllm_mode="colocate", vllm_max_model_length=32 + max_tokens,
            vllm_enable_sleep_mode=False,
        )  # fmt: skip
        tok = AutoTokenizer.from_pretrained(path)
        tok.padding_side = "left"
        timer = StepTimer()
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=correctness, args=config,
                              train_dataset=data, processing_class=tok, callbacks=[timer], peft_config=peft_config)  # fmt: skip
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in trainer.model.parameters())
        trainer.train()
    verifier.close()
    return {"step_seconds": timer.seconds[1:], "trainable_parameters": trainable, "parameters": total}
