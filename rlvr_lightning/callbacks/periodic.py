"""When a callback with an `every_n_steps` setting acts."""


def is_due(rollout_batches: int, every_n_steps: int) -> bool:
    """After every `every_n_steps`-th completed rollout batch; never during training when it is 0."""
    return bool(every_n_steps) and rollout_batches % every_n_steps == 0
