"""An environment of your own (rlvr_lightning.environments.base): a second try after a wrong answer.

    PYTHONPATH=docs/examples make train ARGS="--data.environment my_environment.SecondChance"

A wrong first answer is told so and answered again. The reward (train/reward_environment_mean, added to the
verifier's) is 1 for a right first answer, `second_try` for a right second one; the hint's tokens get no loss.
"""

from rlvr_lightning.environments.base import Environment, Reply
from rlvr_lightning.rewards.extraction import extract_prediction
from rlvr_lightning.rewards.verification import verify_answer


class SecondChance(Environment):
    """A wrong first answer is told so and may try once more; a right first answer earns the most."""

    max_turns = 2

    def __init__(self, second_try: float = 0.5, hint: str = "\nNot quite. Check your work.\n") -> None:
        self.second_try, self.hint = second_try, hint

    def reply(self, episodes):
        replies = []
        for episode in episodes:
            right = verify_answer(episode.answer, extract_prediction(episode.segment))
            if not right and episode.turns < self.max_turns:
                replies.append(Reply(self.hint))
            else:
                replies.append(Reply(reward=float(right) * (1.0 if episode.turns == 1 else self.second_try)))
        return replies
