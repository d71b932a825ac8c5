"""A reward that sees more than the text: it reads the response's length in tokens, and whether it
was cut off, from extra_info (training and validation add both, and so does eval.py; see reward.score_rows).

    score = 0                                      if the response was truncated (it never stopped)
            1                                      if it stopped within BUDGET tokens
            2 - response_length / BUDGET  (>= 0)   else: linearly down to 0 at 2 * BUDGET tokens

Alone it only teaches brevity; add it with a small weight to a correctness reward:

    --reward-fn reward.py:compute_score --reward-fn examples/rewards/length_aware.py --reward-weights 1.0,0.2
"""

BUDGET = 256  # tokens; edit for your task


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature. The length counts every token the model wrote, the final EOS included."""
    info = extra_info or {}
    if "response_length" not in info or "truncated" not in info:
        raise KeyError(
            "length_aware needs extra_info['response_length'] and ['truncated']: "
            "reward.score_rows adds them when given response_ids and truncated (training, validation and eval.py do)"
        )
    if info["truncated"]:
        return 0.0
    return min(1.0, max(0.0, 2.0 - info["response_length"] / BUDGET))
