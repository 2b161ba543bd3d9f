"""A reward function of your own, worked: how close the last \\boxed{} number is to the gold answer.

    python train_small.py --reward integrations/closeness_reward.py:closeness
    torchrun --nproc_per_node=8 train_full.py --reward integrations/closeness_reward.py:closeness ...

It has the form of a TRL reward function (trl.GRPOTrainer(reward_funcs=[closeness])), the form both rungs call
(support/reward_function.py): keyword lists `prompts` and `completions`, every other column of the data by its name
(here `answer`), one float per completion. Math-verify's reward is 1 for an equal answer and 0 otherwise; this one is
real-valued, 1 / (1 + |boxed - answer|) in (0, 1], and 0 without a boxed number or a numeric answer: an answer off by
one scores 0.5, off by 9 scores 0.1, so a group of wrong answers still ranks them (D3S's max-variance selection and
the advantages use the values as they are).

>>> closeness(prompts=["1+1?"] * 3, completions=["\\\\boxed{2}", "so \\\\boxed{3}", "no box"], answer=["2"] * 3)
[1.0, 0.5, 0.0]
"""

import re

BOXED_NUMBER = re.compile(r"\\boxed\{\s*(-?\d+(?:\.\d+)?)\s*\}")


def closeness(prompts, completions, answer, **columns):
    """1 / (1 + |x - answer|) for the last \\boxed{x} of each completion (x a number), else 0."""
    rewards = []
    for completion, gold in zip(completions, answer):
        found = BOXED_NUMBER.findall(completion)
        try:
            rewards.append(1.0 / (1.0 + abs(float(found[-1]) - float(gold))) if found else 0.0)
        except (TypeError, ValueError):  # a gold answer that is not a number (or none)
            rewards.append(0.0)
    return rewards
