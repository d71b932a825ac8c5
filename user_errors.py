"""What a user's function did, in one line for an error message: describe(e) ("raised KeyError: 'x'
(my_reward.py:12, in f)", "called sys.exit(0)"), safe_repr of whatever it returned, and RewardError.
Below reward.py, tools.py and their worker process (reward_worker.py), which all report them."""

import os
import traceback


class RewardError(RuntimeError):
    """A reward function raised, exited, crashed, timed out, or returned something that is not a score."""


def safe_repr(value, limit=80):
    """repr(value), cut to `limit` characters; never raises (a reward may return anything)."""
    try:
        text = repr(value)
    except Exception:  # a broken __repr__, or an int past Python's 4300-digit limit
        text = f"<a {type(value).__name__} that cannot be printed>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(e):
    """What an exception from a reward function says, for an error message: "raised KeyError: 'x'
    (my_reward.py:12, in f)" (the line it was raised at), or "called sys.exit(0)"."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({safe_repr(e.code)})"
    if isinstance(e, RewardError):  # weighted_score's, which already names the function
        return str(e)
    try:
        text = str(e)
    except Exception:
        text = "<a message that cannot be printed>"
    frames = traceback.extract_tb(e.__traceback__)
    at = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""
    return f"raised {type(e).__name__}: {text[:500]}{at}"
