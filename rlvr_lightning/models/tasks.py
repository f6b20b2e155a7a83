"""The embedded tasks by the name `data.train_data` / `data.val_data` gives them: each a seeded train/test split of
problems that have an `id`, a `prompt()` and a `value` (the gold answer)."""

from __future__ import annotations

from rlvr_lightning.models import embedded_task, multiplication_task

EMBEDDED_TASKS = {
    "embedded": embedded_task.train_test_split,  # a+b±c: the default's
    "embedded-multiply": multiplication_task.train_test_split,  # three-digit products: the Python tool's (grpo-tir)
}
