r"""tasks/math.py's math_score: MATH answers compared as mathematics (math-verify), not as strings.

The cases below are labelled by hand: what a careful human grader says about the model's final
\boxed{} answer against the reference answer. `naive_wrong` marks the cases that plain string
comparison (the last \boxed{} content == the ground truth) gets wrong; math-verify gets them right.
The cases where math-verify itself differs from a careful grader are in SURPRISES, each with what
we decided.
"""

import signal
import threading
import time

import pytest

from reward import BUILTIN_SOURCES, compute_score
from tasks.math import MATH_SOURCES, math_score
from tasks.math_verify_worker import last_boxed, math_verify_score

# (response, ground truth, expected score, naive_wrong)
CASES = [
    # fractions and decimals
    (r"So $x = \boxed{\frac{1}{2}}$.", r"\frac{1}{2}", 1, False),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1, True),
    (r"\boxed{1/2}", r"\frac{1}{2}", 1, True),
    (r"\boxed{\dfrac12}", r"\frac{1}{2}", 1, True),
    (r"\boxed{\tfrac{1}{2}}", "0.5", 1, True),
    (r"\boxed{.5}", r"\frac12", 1, True),
    (r"\boxed{\frac{6}{8}}", r"\frac34", 1, True),
    (r"\boxed{0.75}", "3/4", 1, True),
    (r"\boxed{\frac{2}{1}}", r"\frac{1}{2}", 0, False),
    (r"\boxed{0.333}", r"\frac{1}{3}", 0, False),  # three places are not 1/3
    (r"\boxed{0.3333333}", r"\frac{1}{3}", 1, True),  # decimals count when right to 6 places
    (r"\boxed{\frac12}", "12", 0, False),
    # negative numbers
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1, True),
    (r"\boxed{\frac{-1}{2}}", "-0.5", 1, True),
    (r"\boxed{-3}", "-3", 1, False),
    (r"\boxed{- 3}", "-3", 1, True),
    (r"\boxed{3}", "-3", 0, False),
    (r"\boxed{-5}", "5", 0, False),
    # \boxed: the last one is the answer, braces nest, the brace-less and \fbox forms
    (r"First \boxed{3}. Wait, that is wrong: \boxed{4}", "4", 1, False),
    (r"First \boxed{4}. Hmm, no: \boxed{3}", "4", 0, False),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", 1, True),
    (r"so the answer is $\boxed 5$", "5", 1, False),
    (r"$\fbox{5}$", "5", 1, False),
    (r"The answer is \boxed{4}, or rather \boxed{5", "4", 0, False),  # cut off mid-box: no answer
    (r"\boxed{}", "5", 0, False),
    # no \boxed at all: math-verify's own extraction
    (r"The final answer is $\frac{1}{2}$.", "0.5", 1, True),
    ("So it is 0.5", r"\frac{1}{2}", 1, True),
    ("I don't know.", "5", 0, False),
    # units, degrees, currency, percentages
    (r"\boxed{5 \text{ cm}}", "5", 1, True),
    (r"\boxed{5\text{ dollars}}", "5", 1, True),
    (r"\boxed{30^\circ}", "30", 1, True),
    (r"\boxed{45^{\circ}}", "45", 1, True),
    (r"\boxed{\$18.90}", "18.90", 1, True),
    (r"\boxed{50\%}", "50", 1, True),
    (r"\boxed{0.05}", r"5\%", 1, True),
    # intervals
    (r"\boxed{[0, 1)}", "[0,1)", 1, True),
    (r"\boxed{(0,1)}", "[0,1)", 0, False),
    (r"\boxed{(-\infty, 3]}", r"(-\infty,3)", 0, False),
    (r"\boxed{(2,3] \cup [0,1)}", r"[0,1)\cup(2,3]", 1, True),
    (r"\boxed{x \in [0,1)}", "[0,1)", 1, True),
    # sets and lists of solutions
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1, True),
    (r"\boxed{\{1,2,3\}}", r"\{2,1\}", 0, False),
    (r"\boxed{2, 1}", "1, 2", 1, True),
    (r"\boxed{3, 4}", "3", 0, False),  # two answers for one
    (r"\boxed{3}", "3, 4", 0, False),  # one of two solutions
    (r"\boxed{-2, 2}", r"\pm 2", 1, True),
    (r"\boxed{2}", r"\pm 2", 0, False),
    # roots, pi, complex numbers, powers
    (r"\boxed{\sqrt{50}}", r"5\sqrt{2}", 1, True),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1, True),
    (r"\boxed{\sqrt{3}}", "3", 0, False),
    (r"\boxed{\pi \cdot 2}", r"2\pi", 1, True),
    (r"\boxed{6.28}", r"2\pi", 0, False),
    (r"\boxed{3.14}", r"\pi", 0, False),
    (r"\boxed{2i+3}", "3+2i", 1, True),
    (r"\boxed{2^{10}}", "1024", 1, True),
    # thousands separators
    (r"\boxed{1,000}", "1000", 1, True),
    (r"\boxed{1{,}000}", "1000", 1, True),
    (r"\boxed{1\,000}", "1000", 1, True),  # math-verify alone says 0: see SURPRISES
    (r"\boxed{1,000,000}", "1000000", 1, True),
    (r"\boxed{10}", "1000", 0, False),
    (r"\boxed{21}", "12", 0, False),
    # expressions, equations, text and multiple-choice answers, matrices
    (r"\boxed{x^2+7x+10}", "x^2 + 7x + 10", 1, True),
    (r"\boxed{(x+2)(x+5)}", "x^2+7x+10", 1, True),
    (r"\boxed{x=3}", "3", 1, True),
    (r"\boxed{y = 3}", "x=3", 0, False),
    (r"\boxed{\text{(C)}}", r"\text{(C)}", 1, False),
    (r"\boxed{C}", r"\text{(C)}", 1, True),
    (r"\boxed{\text{even}}", r"\text{odd}", 0, False),
    (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", 1, True),
]


def naive_string_score(response, ground_truth):
    """What `naive_wrong` is measured against: the last box's text equals the ground truth's."""
    return 1.0 if last_boxed(response) == ground_truth.strip() else 0.0


@pytest.mark.parametrize("response,truth,expected,naive_wrong", CASES)
def test_hand_labelled_cases(response, truth, expected, naive_wrong):
    assert math_score(response, truth)["score"] == expected
    assert (naive_string_score(response, truth) != expected) == naive_wrong  # the marking is right


def test_the_cases_are_many_and_string_comparison_gets_many_wrong():
    assert len(CASES) >= 50
    wrong = sum(naive_wrong for *_, naive_wrong in CASES)
    assert wrong >= 30, f"string comparison gets only {wrong} of {len(CASES)} cases wrong"


# Where math-verify differs from a careful grader: (response, ground truth, what math_score says, why we keep it)
SURPRISES = [
    # units are dropped, so a wrong unit passes. Kept: MATH's ground truths mostly omit units that
    # models add, and MATH's own answer normalization strips \text{...} units the same way.
    (r"\boxed{5 \text{ m}}", r"5 \text{ cm}", 1, "units are not compared"),
    # a percentage equals both of its readings. Kept: "what percent" problems have either in the ground truth.
    (r"\boxed{50\%}", r"\frac{1}{2}", 1, "50% is 1/2 as well as 50"),
    # degrees are not converted to radians. Kept: an angle asked in degrees should be answered in degrees.
    (r"\boxed{\frac{\pi}{4}}", r"45^\circ", 0, "degrees are not radians"),
    # a time is read as a ratio, 12:30 = 12/30. Kept: rare in MATH, and a fix would be a rule of our own.
    (r"\boxed{\frac{2}{5}}", "12:30", 1, "12:30 is read as the ratio 12/30"),
    # scientific notation is not read. Kept: MATH answers never use it.
    (r"\boxed{1e10}", r"10^{10}", 0, "1e10 is not 10^10"),
    # decimals must be right to 6 places, so a rounded irrational fails
    (r"\boxed{0.7071}", r"\frac{\sqrt{2}}{2}", 0, "4 places are not enough"),
    (r"\boxed{0.70710678}", r"\frac{\sqrt{2}}{2}", 1, "8 places are"),
]


@pytest.mark.parametrize("response,truth,expected,why", SURPRISES)
def test_math_verify_surprises_and_what_we_decided(response, truth, expected, why):
    assert math_score(response, truth)["score"] == expected, why


def test_thin_space_thousands_separator_is_our_one_fix_on_top_of_math_verify():
    # math-verify reads "1\,000" as 1 * 000 = 0; "\," between digit groups is LaTeX for 1 000, so
    # math_verify_score removes it first
    from math_verify import LatexExtractionConfig, parse, verify

    raw = verify(
        parse(r"\boxed{1000}", [LatexExtractionConfig()], parsing_timeout=None),
        parse(r"\boxed{1\,000}", [LatexExtractionConfig()], parsing_timeout=None),
        timeout_seconds=None,
    )
    assert raw is False
    assert math_verify_score(r"\boxed{1\,000\,000}", "1000000") == (1.0, r"1\,000\,000")
    assert math_verify_score(r"\boxed{3\,x}", "3x")[0] == 1.0  # \, elsewhere is left alone


# ----------------------------------------------------------------------------------------------
# the answer that is compared


@pytest.mark.parametrize(
    "text,answer",
    [
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces are text
        (r"\boxed{\left\{ 1 \right.}", r"\left\{ 1 \right."),  # even unbalanced ones
        (r"a \boxed{1} b \boxed{ 2 } c", "2"),
        (r"$\boxed 5$ and more", "5"),
        (r"\boxed {7}", "7"),
        (r"\fbox{8}", "8"),
        (r"\boxed{1} then \boxed{2", None),  # the last box is unclosed: no answer
        (r"\boxedx{1}", None),
        ("no box", None),
        (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
    ],
)
def test_last_boxed(text, answer):
    assert last_boxed(text) == answer


def test_pred_is_the_answer_text_for_majority_voting():
    assert math_score(r"so \boxed{ \frac{1}{2} }", "0.5") == {"score": 1.0, "pred": r"\frac{1}{2}"}
    assert math_score(r"The final answer is $\frac{1}{3}$.", "0.5") == {"score": 0.0, "pred": r"\frac{1}{3}"}
    assert math_score("no answer here", "0.5") == {"score": 0.0, "pred": None}


def test_a_whole_reference_solution_works_as_ground_truth():
    assert math_score(r"\boxed{0.5}", r"So $p = \boxed{\frac{1}{2}}$.")["score"] == 1.0


# ----------------------------------------------------------------------------------------------
# robustness: garbage, bad ground truths, hostile answers, threads


@pytest.mark.parametrize(
    "response",
    [
        "",
        "}}}{{{",
        "\\boxed{",
        r"\boxed{\frac{}{}}",
        r"\boxed{1/0}",
        r"\boxed{\sqrt{-1}}",
        r"\boxed{\infty - \infty}",
        r"\boxed{\boxed{\boxed{}}}",
        "$$$$ \\[ \\] \\( ",
        "\x00\udcff\n\t",
        None,
        12,
    ],
)
def test_garbage_responses_score_zero_and_never_raise(response):
    assert math_score(response, "5")["score"] == 0.0


@pytest.mark.parametrize("truth", ["", "   ", r"\text{}", "}{"])
def test_a_ground_truth_math_verify_cannot_read_is_an_error(truth):
    with pytest.raises(ValueError, match=r"math ground truth .* is not an answer math-verify can read"):
        math_score(r"\boxed{5}", truth)


def test_a_hostile_answer_times_out_to_zero_and_the_next_call_works():
    # 9^(9^(9^9)) has ~10^369693100 digits: sympy would work on it for ever
    start = time.monotonic()
    with pytest.warns(UserWarning, match=r"gave up after 1 s on the answer '9\^"):
        assert math_score(r"\boxed{9^{9^{9^{9}}}}", "2", timeout=1) == {"score": 0.0, "pred": "9^{9^{9^{9}}}"}
    assert time.monotonic() - start < 5
    assert math_score(r"\boxed{2}", "2")["score"] == 1.0  # a fresh worker


def test_math_score_works_in_threads_and_leaves_signal_alarms_alone():
    # math-verify's default timeout is signal.alarm, which only works in the main thread...
    from math_verify import parse

    errors = []
    thread = threading.Thread(target=lambda: errors.append(_raises(lambda: parse(r"\boxed{1}"))))
    thread.start()
    thread.join()
    assert errors == ["ValueError"]
    # ...math_score does not use it: any thread works, and a caller's alarm is left running
    scores = []
    thread = threading.Thread(target=lambda: scores.append(math_score(r"\boxed{2}", "2")["score"]))
    thread.start()
    thread.join()
    assert scores == [1.0]
    signal.alarm(100)
    math_score(r"\boxed{2}", "2")
    assert signal.alarm(0) > 90  # still pending (math-verify's own timeout would have cancelled it)


def test_a_dead_worker_is_replaced_and_one_that_cannot_start_is_a_clear_error(monkeypatch):
    from tasks import math_verify_worker

    math_score(r"\boxed{2}", "2")
    math_verify_worker._math_worker["process"].kill()  # killed from outside (the OOM killer, say)
    assert math_score(r"\boxed{2}", "2")["score"] == 1.0
    math_verify_worker._stop_math_worker()
    monkeypatch.setattr(math_verify_worker.sys, "executable", "/bin/false")  # a Python without math-verify, in effect
    with pytest.raises(RuntimeError, match="worker process could not start.*math-verify installed"):
        math_score(r"\boxed{2}", "2")


def _raises(fn):
    try:
        fn()
    except Exception as e:
        return type(e).__name__
    return None


# ----------------------------------------------------------------------------------------------
# dispatch


def test_compute_score_sends_verls_math_sources_to_math_score():
    assert MATH_SOURCES == {"lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"}
    assert MATH_SOURCES <= BUILTIN_SOURCES
    for source in MATH_SOURCES:
        assert compute_score(source, r"\boxed{\frac{1}{2}}", "0.5") == {"score": 1.0, "pred": r"\frac{1}{2}"}
    assert compute_score("openai/gsm8k", "#### 72", "72") == 1.0  # the others still return floats
