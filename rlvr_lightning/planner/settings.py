"""The `plan:` section of `make train` and `make plan`: which device to plan for, and whether
`make train` checks the plan before it builds anything heavy."""

from __future__ import annotations

from rlvr_lightning.errors import ConfigError
from rlvr_lightning.planner.hardware import CHOICES


class PlanSettings:
    def __init__(
        self,
        check: bool = True,
        hardware: str | None = None,
        device_gib: float | None = None,
        mean_prompt_length: float | None = None,
        mean_response_length: float | None = None,
        tool_calls_per_answer: float | None = None,
        tool_call_ms: float | None = None,
    ) -> None:
        """Every argument is a CLI flag, `--plan.<name>`.

        Args:
            check: `make train` plans the run first: on a GPU it refuses a run predicted not to fit (naming the
                first change that does), on the CPU it warns. `false` skips the plan.
            hardware: the device to plan for (h100, h200, a100-80g, a100-40g, l40s, cpu); default: the
                machine's own (its GPU's memory as CUDA reports it, or the CPU).
            device_gib: the device's memory in GiB, instead of the hardware's.
            mean_prompt_length: the mean prompt length the step time is expected at (default: the limit,
                `data.max_prompt_length`). Memory is planned at the limits whatever this is.
            mean_response_length: the mean response length the step time is expected at (default: the limit,
                `rollout.max_response_length`: every response at the cap, the worst case).
            tool_calls_per_answer: with the Python tool, the calls an answer is expected to make (default: its
                most, `data.tool.max_calls`); the worst case makes the most, each to its time limit.
            tool_call_ms: a call's expected wall time (default: 63 ms, a warm call importing sympy on a 2-core
                CPU, bench/results/sandbox.json).
        """
        if hardware is not None and hardware not in CHOICES:
            raise ConfigError(f"plan.hardware: unknown hardware {hardware!r}; valid: {', '.join(CHOICES)}")
        if device_gib is not None and device_gib <= 0:
            raise ConfigError(f"plan.device_gib must be > 0, got {device_gib}")
        for name, mean in (("mean_prompt_length", mean_prompt_length), ("mean_response_length", mean_response_length),
                           ("tool_call_ms", tool_call_ms)):  # fmt: skip
            if mean is not None and mean <= 0:
                raise ConfigError(f"plan.{name} must be > 0, got {mean}")
        if tool_calls_per_answer is not None and tool_calls_per_answer < 0:
            raise ConfigError(f"plan.tool_calls_per_answer must be ≥ 0, got {tool_calls_per_answer}")
        self.check, self.hardware, self.device_gib = check, hardware, device_gib
        self.mean_prompt_length, self.mean_response_length = mean_prompt_length, mean_response_length
        self.tool_calls_per_answer, self.tool_call_ms = tool_calls_per_answer, tool_call_ms
