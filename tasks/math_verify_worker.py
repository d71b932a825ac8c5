r"""math-verify's comparison of MATH answers (math_verify_score: the last \boxed{}, last_boxed), and the
worker process that runs it for tasks/math.py's math_score, so that no answer can hang or stop the run.

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
import re
import select
import subprocess
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_math_worker = {"pid": None, "process": None}
_math_lock = threading.Lock()


# ----------------------------------------------------------------------------------------------
# What the worker runs: the answer in the last \boxed{}, compared with math-verify

# "1\,000" is a LaTeX thousands separator, which math-verify reads as a product (1 * 000 = 0)
THIN_SPACE = re.compile(r"(?<=\d)\\,(?=\d{3}(?!\d))")


def last_boxed(text):
    r"""The content of the last \boxed{...} (or \fbox{...}) in `text`, or None if there is none.

    Braces are matched, so "\boxed{\frac{1}{2}}" gives "\frac{1}{2}"; escaped braces (\{ \}) are
    text, not grouping. The brace-less form "\boxed 5" gives what follows up to the next '$' or
    line end. The last box is the answer even when it cannot be read: an unclosed "\boxed{" (a
    response cut off mid-answer) gives None, never an earlier box.
    """
    at = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if at < 0:
        return None
    command = re.match(r"\\(?:boxed|fbox)(\s*)", text[at:])
    rest = text[at + command.end() :]
    if not rest.startswith("{"):
        if not command.group(1):  # "\boxedx" is some other command
            return None
        answer = re.split(r"[$\n]", rest, maxsplit=1)[0].strip()
        return answer or None
    depth = 0
    for token in re.finditer(r"\\.|[{}]|[^\\{}]+", rest, re.DOTALL):  # \x pairs first: "\{" is text
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            depth -= 1
            if depth == 0:
                return rest[1 : token.start()].strip()
    return None


def math_verify_score(solution_str, ground_truth):
    r"""(score, pred) for one response, with no time limit: the comparison math_score runs in its
    worker process. score is 1.0 if the answer equals the ground truth as mathematics, else 0.0;
    pred is the answer text that was compared (None if the response gave none).

    The answer is the last \boxed{...}; a response with no \boxed at all falls back to math-verify's
    own extraction (the last LaTeX or plain expression, "The final answer is $x$" first).
    math-verify then compares values, not strings: 0.5 = \frac{1}{2} = 1/2 = \dfrac12 = 50\%,
    {1,2} = {2,1}, [0,1) != (0,1), \sqrt{50} = 5\sqrt{2}, "x = 3" equals 3, decimals to 6 places.
    The one rule we add: a thin space between digit groups is dropped first (1\,000 = 1000).
    Units and degree signs are dropped ("5 \text{ cm}" = 5, "30^\circ" = 30), as the MATH
    benchmark's own answer normalization does; we keep that, so "5 m" also equals "5 cm".

    Garbage in the response scores 0. A ground truth math-verify cannot read is a ValueError: it is
    a data bug, and a silent 0 would train on it (every sample of that prompt scoring 0).
    """
    # imported here, not at the top: only math_score's worker process needs sympy
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    truth = str(ground_truth)
    truth = THIN_SPACE.sub("", last_boxed(truth) or truth)  # a whole reference solution works too
    # parsing_timeout=None, timeout_seconds=None: no signal.alarm (see math_score); math-verify's
    # own error handling stays on (raise_on_error=False), so bad input gives [] / False, not errors
    gold = parse("\\boxed{" + truth + "}", [LatexExtractionConfig()], parsing_timeout=None)
    if not gold:
        raise ValueError(
            f"math ground truth {ground_truth!r} is not an answer math-verify can read; expected the content of "
            "the reference solution's last \\boxed{}, e.g. '\\frac{1}{2}' (data_prep.py math writes it)"
        )
    try:
        answer = last_boxed(solution_str)
        if answer is not None:
            found = parse(
                "\\boxed{" + THIN_SPACE.sub("", answer) + "}",
                [LatexExtractionConfig(), ExprExtractionConfig()],
                parsing_timeout=None,
            )
        elif "\\boxed" in solution_str or "\\fbox" in solution_str:
            found = []  # the last box is unreadable: no answer, not a hunt for another one
        else:
            found = parse(solution_str, [LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None)
            answer = found[-1] if found and isinstance(found[-1], str) else None  # the text it matched
        correct = bool(found) and verify(gold, found, timeout_seconds=None)
    except Exception:  # math-verify catches its own errors; this makes "never raises" ours to promise
        return 0.0, None
    return (1.0 if correct else 0.0), answer


# ----------------------------------------------------------------------------------------------
# The worker process


def serve():
    """The worker's loop: one JSON request [solution_str, ground_truth] per stdin line, one JSON
    reply per stdout line: {"score", "pred"} or {"error"}. Ends when stdin closes."""
    import logging

    import math_verify  # noqa: F401  (imported before "ready", so the first request is not charged for it)

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
