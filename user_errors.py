"""Errors told to the user in one line. What a user's function did: describe(e) ("raised KeyError: 'x'
(my_reward.py:12, in f)", "called sys.exit(0)"), safe_repr of whatever it returned, and RewardError.
And record_root_cause, which makes such a line what torchrun prints last about a failed rank. Below
reward.py, tools.py, their worker process (reward_worker.py), config.py and distributed.py."""

import json
import os
import time
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


def record_root_cause(message):
    """Under torchrun, make `message` what torchrun prints last as this rank's failure (its error
    file, the one torch.distributed.elastic's @record writes for an exception). Without it a clear
    one-line error is followed by torchrun's own 40-line traceback and a summary that says only
    "exitcode: 1". The first failure recorded wins."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    extra = {"py_callstack": message, "timestamp": str(int(time.time()))}
    with open(path, "w") as f:
        json.dump({"message": {"message": message, "extraInfo": extra}}, f)
