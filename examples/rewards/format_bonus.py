r"""A format reward: 1 if the response gives a final answer in \boxed{...}, as the MATH prompt asks
(data_prep.py math), else 0. It does not check that the answer is right, so give it a small weight
next to the correctness reward:

    --reward-fn reward.py:compute_score --reward-fn examples/rewards/format_bonus.py --reward-weights 1.0,0.1

Each function's own score is logged too: reward_extra/reward.compute_score/mean and
reward_extra/format_bonus.compute_score/mean.
"""

# the answer the MATH reward reads, found the same way (train_grpo.py's directory, the repo root,
# is on sys.path, so a reward file can import the repo's modules)
from tasks.math import last_boxed


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    r"""verl's signature: 1.0 if the response's last \boxed is closed and not empty, else 0.0.
    An unclosed one (a response cut off mid-answer) counts as no answer, as in tasks/math.py's math_score."""
    return 1.0 if last_boxed(solution_str) else 0.0
