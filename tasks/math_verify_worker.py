r"""The worker process that runs math-verify for tasks/math.py's math_score, so that no answer can
hang or stop the run.

math-verify 0.9.0's own timeouts (parse's parsing_timeout and verify's timeout_seconds, 5 s each by
default) use signal.alarm: called outside the main thread (a reward run from a thread pool) they raise
ValueError, they cancel any alarm the caller had set, and a signal only lands between Python bytecodes,
never inside one long C call. Turned off (None), hostile answers hang: \boxed{9^{9^{9^{9}}}},
\boxed{(10^{10})!}, \boxed{(x+1)^{100000}} each ran past 20 s before we stopped them. So math_score
runs math-verify, timeouts off, in a child process that ask() kills after `timeout` seconds: no
signals, any thread, and every hang ends. One child per process (a forked process starts its own),
started on first use, restarted after a kill; callers take turns.

    this process: ask(solution_str, ground_truth, timeout)  ---->  the worker, serve(): one JSON line each way,
                  (reply, None) or (None, what went wrong)  <----  math_verify_score's {"score", "pred"} or {"error"}
"""

import atexit
import json
import os
import select
import subprocess
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_math_worker = {"pid": None, "process": None}
_math_lock = threading.Lock()


def serve():
    """The worker's loop: one JSON request [solution_str, ground_truth] per stdin line, one JSON
    reply per stdout line: {"score", "pred"} or {"error"}. Ends when stdin closes."""
    import logging

    import math_verify  # noqa: F401  (imported before "ready", so the first request is not charged for it)

    from tasks.math import math_verify_score

    # its "Timeout is disabled" warning: the timeout is math_score's, which kills this process
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    print("ready", flush=True)
    for line in sys.stdin:
        solution_str, ground_truth = json.loads(line)
        try:
            score, pred = math_verify_score(solution_str, ground_truth)
            reply = {"score": score, "pred": pred}
        except ValueError as e:
            reply = {"error": str(e)}
        print(json.dumps(reply), flush=True)


def _stop_math_worker():
    process = _math_worker["process"]
    if process is not None and _math_worker["pid"] == os.getpid():
        process.kill()
        process.wait()
        process.stdin.close()
        process.stdout.close()
    _math_worker.update(pid=None, process=None)


atexit.register(_stop_math_worker)


def _start_math_worker():
    """This process's worker, started if there is none (or it died, or we are a forked child)."""
    process = _math_worker["process"]
    if process is not None and _math_worker["pid"] == os.getpid() and process.poll() is None:
        return process
    code = f"import sys; sys.path.insert(0, {REPO!r}); from tasks import math_verify_worker; math_verify_worker.serve()"
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if process.stdout.readline().strip() != "ready":  # it failed to import; its traceback is on stderr
        process.kill()
        raise RuntimeError(
            "math_score's worker process could not start (its error is printed above); is math-verify installed? "
            "pip install -r requirements.txt"
        )
    _math_worker.update(pid=os.getpid(), process=process)
    return process


def ask(solution_str, ground_truth, timeout):
    """(the worker's reply, None) for one response: {"score", "pred"} or {"error"}; or (None, what
    happened) when it gave none within `timeout` seconds, or died on it (it is then killed)."""
    request = json.dumps([solution_str, ground_truth]) + "\n"
    with _math_lock:
        for _ in range(2):  # a worker found dead is replaced once; dying twice is this answer's doing
            process = _start_math_worker()
            try:
                process.stdin.write(request)
                process.stdin.flush()
                ready, _, _ = select.select([process.stdout], [], [], timeout)
                line = process.stdout.readline() if ready else ""
            except OSError:  # it had died before we wrote
                ready, line = True, ""
            if line:
                break
            _stop_math_worker()
            if not ready:
                break  # timed out: the same answer would time out again
    if not line:
        return None, (f"gave up after {timeout} s" if not ready else "the worker died on it")
    return json.loads(line), None
