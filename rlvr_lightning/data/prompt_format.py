"""How a problem becomes the prompt the policy answers: the run's template, in the tokenizer's chat template if the
run asks for it. A plain value the data module makes at setup, so that what draws prompts keeps no data module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlvr_lightning.data.sources import ProblemRecord
from rlvr_lightning.rollout.types import PromptBatch


@dataclass(frozen=True)
class PromptFormat:
    template: str  # `data.prompt_template`, with a `{problem}` field
    use_chat_template: bool
    tokenizer: Any

    def text(self, problem: str) -> str:
        text = self.template.format(problem=problem)
        if self.use_chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        return text

    def token_ids(self, problem: str) -> list[int]:
        return self.tokenizer(self.text(problem), add_special_tokens=False).input_ids

    def batch(self, records: list[ProblemRecord]) -> PromptBatch:
        return PromptBatch(
            ids=[r.id for r in records], prompts=[self.text(r.problem) for r in records], answers=[r.answer for r in records]
        )
