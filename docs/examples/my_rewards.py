"""Your own reward functions, added to the verifier's (the model's `rewards.functions`, docs/pieces.md):

    PYTHONPATH=docs/examples make train ARGS="--model.init_args.rewards.functions='[{function: my_rewards.brevity, weight: 0.1}, {function: my_rewards.shows_work}]'"

Each gets one completion (the model's own words), its gold answer and a little metadata, and returns a reward
(or a reward and metrics of its own); the run logs train/reward_brevity_mean, train/reward_shows_work_steps, ….
"""


def brevity(completion: str, gold: str, metadata: dict) -> float:
    """Shorter answers score more: 1 for none at all, falling with every 16 tokens; 0 for one cut at the limit."""
    if metadata["truncated"]:
        return 0.0
    return 1.0 / (1.0 + metadata["response_tokens"] / 16)


def shows_work(completion: str, gold: str, metadata: dict) -> tuple[float, dict]:
    """1 for a completion that writes a step of working (an equation) before its answer, and how many it wrote."""
    steps = completion.count("=")
    return float(steps > 0), {"steps": steps}
