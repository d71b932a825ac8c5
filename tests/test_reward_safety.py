"""What a --reward-fn function may do to the run: raise, sys.exit, os._exit, hang in Python or in C,
segfault, return what is not a score. Each is a reward error for that sample, named with the step and
the sample; nothing ends or hangs the trainer (reward.load_reward_fns, reward_worker.py).

load_reward_fns runs the functions in a worker process; these tests call it as the trainer does,
through score_responses / score_rows (errors="raise" for --reward-errors raise, "skip" for skip)."""

import fractions
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import reward_worker
from reward import RewardError, load_reward_fns, read_score, score_responses, score_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One reward file whose answer to each response text is a different misbehaviour. It scores an
# ordinary response len(response), so a reply that belongs to another sample shows.
HOSTILE = """
import ctypes, os, sys, time

calls = 0  # module-level state: must persist from call to call

def f(data_source, solution_str, ground_truth, extra_info=None):
    global calls
    calls += 1
    s = solution_str
    if s == "raise":
        raise KeyError("missing_field")
    if s == "sys.exit":
        sys.exit(0)
    if s.startswith("os._exit"):
        os._exit(int(s[-1]))
    if s == "hang":
        time.sleep(1000)
    if s == "hang in C":
        ctypes.CDLL(None).sleep(1000)  # no Python signal handler runs inside this
    if s == "segfault":
        ctypes.string_at(0)
    if s == "huge":
        return 10**400
    if s == "text":
        return "1.0"
    if s == "nan":
        return float("nan")
    if s == "no score":
        return {"value": 1.0}
    if s == "nan extra":
        return {"score": 1.0, "acc": float("nan"), "half": 0.5}
    if s == "print":
        print("a reward that prints")  # must not get into the worker's replies
        return 2.0
    if s == "calls":
        return {"score": 0.0, "calls": calls}
    if s == "lambda":
        return {"score": 1.0, "how": lambda: 1}  # cannot be pickled in the worker
    if s == "own class":
        return {"score": 1.0, "how": Own()}  # cannot be pickled either: its module is not importable
    if s == "bad pickle":
        return {"score": 1.0, "how": BadPickle()}  # pickled in the worker, fails to load in the caller
    return float(len(s))


class Own:
    pass


class BadPickle:
    def __reduce__(self):
        return int, ("not a number",)
"""


@pytest.fixture(scope="module")
def hostile_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "hostile.py"
    path.write_text(HOSTILE)
    return str(path)


@pytest.fixture
def hostile(hostile_file):
    fn = load_reward_fns([hostile_file + ":f"], timeout=2)
    yield fn
    fn.close()


def score(fn, responses, errors="raise", where="step 3", first=0):
    """score_responses over responses, all of data_source 'ds', numbered from `first`."""
    n = len(responses)
    return score_responses(
        fn, ["ds"] * n, responses, ["1"] * n, indices=range(first, first + n), errors=errors, where=where
    )


# ----------------------------------------------------------------------------------------------
# every misbehaviour is one sample's reward error: raise names it, skip scores it 0


CASES = {
    "raise": "raised KeyError: 'missing_field' (hostile.py:",
    "sys.exit": "called sys.exit(0)",
    "os._exit 0": "ended its worker process with exit code 0",
    "os._exit 3": "ended its worker process with exit code 3",
    "hang": "did not return within 2 s (--reward-timeout)",
    "hang in C": "did not return within 2 s (--reward-timeout)",
    "segfault": "crashed its worker process (SIGSEGV",
    "huge": "returned 1000000000",
    "text": "returned '1.0' (a str); expected a real number",
    "nan": "returned nan",
    "no score": "returned a dict without 'score'",
    "lambda": "returned a value that cannot be sent back from the reward worker",
    "own class": "returned a value that cannot be sent back from the reward worker",
    "bad pickle": "returned a value that cannot be sent back from the reward worker (ValueError: invalid literal",
}


# score_responses in a fresh process that prints what it got: a reward run in the caller's own process
# that calls os._exit(0) would end it with exit code 0 and nothing said, which a test there cannot see
CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from reward import RewardError, load_reward_fns, score_responses
fn = load_reward_fns([sys.argv[2]], timeout=2)
for batch in json.loads(sys.argv[3]):
    n = len(batch)
    try:
        scores, extras = score_responses(
            fn, ["ds"] * n, batch, ["1"] * n, indices=range(16, 16 + n), errors=sys.argv[4], where="step 3"
        )
        print(json.dumps(dict(scores=scores, errors=extras.get("reward_error"))), flush=True)
    except RewardError as e:
        print(json.dumps(dict(raised=str(e))), flush=True)
"""


def score_in_child(spec, batches, errors):
    """What score_responses gave for each batch of responses ({scores, errors} or {raised: message}),
    run in a child process, and its stderr."""
    cmd = [sys.executable, "-c", CHILD, REPO, spec, json.dumps(batches), errors]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and len(results) == len(batches), f"exit code {proc.returncode}:\n{proc.stderr[-3000:]}"
    return results, proc.stderr


@pytest.mark.parametrize("response", CASES)
def test_raise_stops_naming_function_step_sample_source_and_what_happened(hostile_file, response):
    (stopped, after), _ = score_in_child(hostile_file + ":f", [["ok", response, "ok"], ["a", "bb"]], "raise")
    message = stopped["raised"]
    assert message.startswith("reward function hostile.f, step 3, sample 17 of the batch (data_source='ds'): ")
    assert CASES[response] in message and "--reward-errors skip" in message
    assert after == dict(scores=[1.0, 2.0], errors=None)  # the next batch is scored as usual


@pytest.mark.parametrize("response", CASES)
def test_skip_scores_it_zero_counts_it_and_goes_on(hostile_file, response):
    (result,), err = score_in_child(hostile_file + ":f", [["ok", response, "abc"]], "skip")
    assert result == dict(scores=[2.0, 0.0, 3.0], errors=[0.0, 1.0, 0.0])
    assert "reward errors: 1 of 3 samples scored 0 (--reward-errors skip)" in err and CASES[response] in err


def test_every_kind_of_error_in_one_batch(hostile_file):
    responses = ["a", *CASES, "bb"]
    t = time.perf_counter()
    (result,), err = score_in_child(hostile_file + ":f", [responses], "skip")
    assert result == dict(scores=[1.0] + [0.0] * len(CASES) + [2.0], errors=[0.0] + [1.0] * len(CASES) + [0.0])
    assert time.perf_counter() - t < 30  # two time-outs of 2 s and a few new workers
    assert f"{len(CASES)} of {len(responses)} samples scored 0" in err


def test_raise_stops_at_the_first_error_without_scoring_the_rest(hostile):
    t = time.perf_counter()
    with pytest.raises(RewardError, match="sample 0 .*KeyError"):
        score(hostile, ["raise", "hang", "hang"])
    assert time.perf_counter() - t < 1.5  # not 2 x 2 s waiting for the hangs
    assert score(hostile, ["ccc", "d"]) == ([3.0, 1.0], {})  # no reply left over from the stopped batch


def test_module_state_persists_until_the_worker_is_replaced(hostile):
    _, extras = score(hostile, ["calls"] * 3)
    _, more = score(hostile, ["calls"] * 2)
    assert extras["calls"] + more["calls"] == [1, 2, 3, 4, 5]  # one long-lived worker
    _, extras = score(hostile, ["calls", "os._exit 1", "calls"], errors="skip")
    assert extras["calls"] == [6, None, 1]  # a new worker loads the file afresh


def test_what_a_reward_prints_goes_to_stderr_not_into_the_replies(hostile_file, capfd):
    fn = load_reward_fns([hostile_file + ":f"])  # started here, so that its stderr is the one captured
    assert score(fn, ["print", "abc"]) == ([2.0, 3.0], {})
    fn.close()
    assert "a reward that prints" in capfd.readouterr().err


def test_score_rows_names_the_step_and_the_samples_place_in_the_batch(hostile):
    rows = [{"data_source": "my/source", "reward_model": {"ground_truth": "1"}}] * 2
    with pytest.raises(
        RewardError, match=r"hostile.f, validation at step 2, sample 9 of the batch \(data_source='my/source'\)"
    ):
        score_rows(hostile, rows, ["ok", "raise"], first=8, where="validation at step 2")
    with pytest.raises(RewardError, match=r"hostile.f, sample 1 \(data_source='my/source'\): raised KeyError"):
        score_rows(hostile, rows, ["ok", "raise"])  # no `where`: the API's default


def test_in_process_functions_count_sys_exit_as_an_error_too():
    def leaves(data_source, solution_str, ground_truth, extra_info=None):
        sys.exit("bye")

    with pytest.raises(RewardError, match=r"leaves, step 1, sample 0 of the batch .*called sys.exit\('bye'\)"):
        score_responses(leaves, ["ds"], ["x"], ["1"], where="step 1")


# ----------------------------------------------------------------------------------------------
# what counts as a score, and what happens to extra keys


@pytest.mark.parametrize(
    "value,expected",
    [
        (1, 1.0),
        (True, 1.0),
        (0.25, 0.25),
        (np.float32(0.5), 0.5),
        (np.int64(2), 2.0),
        (np.bool_(True), 1.0),
        (np.array(0.75), 0.75),
        (torch.tensor(0.5), 0.5),
        (torch.tensor(3), 3.0),
        (fractions.Fraction(1, 4), 0.25),
    ],
)
def test_real_numbers_are_scores(value, expected):
    score, _ = read_score(value)
    assert score == expected and type(score) is float


@pytest.mark.parametrize(
    "value,says",
    [
        ("1.0", "returned '1.0' (a str)"),
        (b"1", "returned b'1' (a bytes)"),
        (None, "returned None (a NoneType)"),
        ([1.0], "returned [1.0] (a list)"),
        (torch.tensor([1.0]), "(a Tensor)"),  # one element, but not a scalar
        (1j, "returned 1j (a complex)"),
        (10**400, "returned 10000000000"),
        (float("inf"), "returned inf; expected a finite number"),
        (fractions.Fraction(10**400), "expected a finite number"),
        ({"value": 1.0}, "returned a dict without 'score' (its keys: ['value'])"),
    ],
)
def test_anything_else_is_not_a_score(value, says):
    with pytest.raises(ValueError) as err:
        read_score(value)
    assert says in str(err.value) and len(str(err.value)) < 300  # 10**400's 401 digits are cut short


def test_numbers_come_back_from_the_worker_as_python_numbers(tmp_path):
    path = tmp_path / "numpy_reward.py"
    path.write_text(
        "import numpy as np\n"
        "def f(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': np.float32(0.5), 'acc': np.bool_(True), 'tokens': np.int64(7), 'pred': 'x'}\n"
    )
    fn = load_reward_fns([f"{path}:f"])
    scores, extras = score_responses(fn, ["ds"], ["r"], ["1"])
    fn.close()
    assert scores == [0.5] and extras == {"acc": [True], "tokens": [7], "pred": ["x"]}
    assert type(extras["acc"][0]) is bool and type(extras["tokens"][0]) is int  # logged by run_log as numbers


def test_a_nan_extra_is_left_out_of_the_mean_and_reported(hostile, capsys):
    scores, extras = score(hostile, ["ok", "nan extra"], errors="skip")
    assert scores == [2.0, 1.0] and extras["reward_error"] == [0.0, 0.0]  # the score itself is fine
    assert extras["acc"] == [None, None] and extras["half"] == [None, 0.5]
    err = capsys.readouterr().err
    assert "reward extras: 1 values are not finite numbers and are left out of reward_extra/<key>/mean" in err
    assert "step 3, sample 1 of the batch (data_source='ds'): 'acc' = nan" in err


def test_extras_that_are_not_numbers_or_text_are_kept_with_a_warning():
    def listing(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1.0, "steps": [1, 2]}

    with pytest.warns(UserWarning, match="list values in extra key 'steps': kept in extras, not logged"):
        _, extras = score_responses(listing, ["ds"], ["r"], ["1"])
    assert extras == {"steps": [[1, 2]]}


# ----------------------------------------------------------------------------------------------
# the worker process: loading, cost, clean-up


def test_a_file_that_cannot_load_is_an_error_at_load_time(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    with pytest.raises(RuntimeError, match=r"--reward-fn .*broken.py:f: could not load .*SyntaxError"):
        load_reward_fns([f"{broken}:f"])
    leaving = tmp_path / "leaving.py"
    leaving.write_text("import os\nos._exit(0)\n")
    with pytest.raises(RuntimeError, match="exit code 0 .*while loading"):
        load_reward_fns([f"{leaving}:f"])
    other = tmp_path / "other.py"
    other.write_text("def h(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with pytest.raises(RuntimeError, match=r"has no function 'g'; its functions: \['h'\]"):
        load_reward_fns([f"{other}:g"])


def test_the_worker_costs_little_per_sample(tmp_path):
    # 2048 GSM8K-sized samples (a response of ~300 tokens each, their ids in extra_info, as the trainer
    # sends them); measured at about 0.1 s on 2 cores, against 0.04 s in this process
    path = tmp_path / "gsm8k_reward.py"
    path.write_text(
        f"import sys\nsys.path.insert(0, {REPO!r})\nfrom tasks.gsm8k import gsm8k_score\n"
        "def f(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return gsm8k_score(solution_str, ground_truth)\n"
    )
    fn = load_reward_fns([f"{path}:f"])
    text = "Natalia sold 48/2 = <<48/2=24>>24 clips in May. " * 12 + "#### 72"
    rows = [
        {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "72"}, "extra_info": {"index": i}}
        for i in range(2048)
    ]
    ids = [list(range(1000, 1300))] * 2048
    score_rows(fn, rows[:8], [text] * 8, response_ids=ids[:8])  # warm
    t = time.perf_counter()
    scores, _ = score_rows(fn, rows, [text] * 2048, response_ids=ids, truncated=[False] * 2048)
    took = time.perf_counter() - t
    fn.close()
    assert scores == [1.0] * 2048 and took < 2.0, took


def pid_alive(pid):
    """Whether `pid` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid, seconds=10):
    deadline = time.time() + seconds
    while pid_alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    return not pid_alive(pid)


def test_a_process_with_over_1024_open_files_still_hears_its_worker(hostile_file):
    # select() cannot watch a descriptor past 1024, and a trainer with vLLM holds many files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open only {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        fn = load_reward_fns([hostile_file + ":f"])  # its pipes get descriptors past 1024
        assert score(fn, ["a", "bb"]) == ([1.0, 2.0], {})
        fn.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_close_stops_the_worker(hostile):
    pid = hostile.pid
    assert pid_alive(pid)
    hostile.close()
    assert hostile.pid is None and wait_gone(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_worker_dies_with_a_killed_trainer_even_mid_call(tmp_path):
    # the trainer killed with -9 while its reward function hangs in C: no atexit runs, and the worker
    # never gets back to reading its closed stdin
    path = tmp_path / "stuck.py"
    path.write_text(
        "import ctypes\n"
        "def f(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    open(solution_str, 'w').close()  # the call has begun\n"
        "    ctypes.CDLL(None).sleep(1000)\n"
    )
    marker = tmp_path / "in_the_call"
    trainer = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {REPO!r})
        from reward import load_reward_fns, score_responses
        fn = load_reward_fns([{str(path) + ":f"!r}], timeout=1000)
        print(fn.pid, flush=True)
        score_responses(fn, ["ds"], [{str(marker)!r}], ["1"])
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", trainer], stdout=subprocess.PIPE, text=True)
    worker = int(proc.stdout.readline())
    deadline = time.time() + 60
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists() and pid_alive(worker)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_gone(worker)


def test_a_rank_stopped_mid_call_says_which_function_it_waits_on_and_for_how_long(tmp_path):
    # its peers gave up on it and say "its own output says why": torchrun then sends it SIGTERM
    path = tmp_path / "stuck.py"
    path.write_text(
        "import time\n"
        "def my_reward(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    open(solution_str, 'w').close()  # the call has begun\n"
        "    time.sleep(1000)\n"
    )
    marker = tmp_path / "in_the_call"
    rank = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {REPO!r})
        from distributed import catch_stop_signals
        from reward import load_reward_fns, score_responses
        fn = load_reward_fns([{str(path) + ":my_reward"!r}], timeout=100)
        catch_stop_signals()
        score_responses(fn, ["ds"], [{str(marker)!r}], ["1"])
        """
    )
    env = {**os.environ, "RANK": "1"}
    proc = subprocess.Popen([sys.executable, "-c", rank], stdout=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 60
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1.2)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1)  # it prints at once, and goes on waiting
    finally:
        proc.kill()
        out = proc.communicate()[0]
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("rank 1: SIGTERM: stopping at the next step boundary"), out
    said = lines[1]
    assert said.startswith("rank 1: SIGTERM came while waiting "), said
    seconds, rest = said.removeprefix("rank 1: SIGTERM came while waiting ").split(" ", 1)
    assert int(seconds) >= 1
    assert rest == "s on reward function my_reward (stuck.py), which --reward-timeout allows 100 s"


def test_what_one_call_prints_is_capped(tmp_path, capfd):
    # a function that prints 200 MB must not fill the run's log: 64 KiB of each call's prints, then a note
    path = tmp_path / "loud.py"
    path.write_text(
        "import os, subprocess, sys\n"
        "def f(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    n = int(solution_str)\n"
        "    print('p' * n)  # Python's stdout\n"
        "    os.write(2, b'w' * n)  # the descriptor itself, as C code writes\n"
        "    subprocess.run([sys.executable, '-c', f'print(\"c\" * {n})'])  # and a child's\n"
        "    return 1.0\n"
    )
    fn = load_reward_fns([f"{path}:f"])
    capfd.readouterr()
    assert score(fn, ["1000000", "10"]) == ([1.0, 1.0], {})
    assert fn.dropped == [3 * 1000001 - 1 - reward_worker.OUTPUT_CAP, 0]
    err = capfd.readouterr().err
    fn.close()
    note = f"[reward worker: one call printed 3,000,002 bytes; the first {reward_worker.OUTPUT_CAP:,} are above, the rest was dropped]"
    assert note in err and len(err) < reward_worker.OUTPUT_CAP + 500, len(err)
    assert err.endswith(f"{note}\n" + "p" * 10 + "\n" + "w" * 10 + "c" * 10 + "\n")  # the next call starts anew


DAEMON = """
import os, sys, time
if os.fork():  # a double fork: the daemon's parent exits, so the worker is no longer its ancestor
    os._exit(0)
os.setsid()  # and a session of its own: a kill of the worker's process group misses it
if os.fork():
    os._exit(0)
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(1000)
"""


def test_closing_the_worker_kills_what_its_functions_started_even_a_daemon(tmp_path):
    (tmp_path / "daemon.py").write_text(DAEMON)
    path = tmp_path / "spawns.py"
    path.write_text(
        "import subprocess, sys\n"
        "def f(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    subprocess.run([sys.executable, {str(tmp_path / 'daemon.py')!r}, solution_str])\n"
        "    return 1.0\n"
    )
    fn = load_reward_fns([f"{path}:f"])
    pid_file = tmp_path / "daemon.pid"
    assert score(fn, [str(pid_file)]) == ([1.0], {})
    deadline = time.time() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.time() < deadline
        time.sleep(0.05)
    daemon = int(pid_file.read_text())
    try:
        assert pid_alive(daemon)
        fn.close()
        assert wait_gone(daemon, seconds=5)
    finally:
        if pid_alive(daemon):
            os.kill(daemon, signal.SIGKILL)


# ----------------------------------------------------------------------------------------------
# validation honours --reward-errors too (eval.validate, as the trainer's run_validation calls it)


def test_validate_with_errors_skip_counts_them_and_raise_names_validation(tmp_path, capsys):
    from transformers import AutoTokenizer

    import data_prep
    from engine import Rollout
    from eval import validate
    from models import build_tiny_model
    from tasks.digits import TASK_WORDS, write_digits

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(str(tmp_path / "model"), TASK_WORDS))
    write_digits(str(tmp_path / "data"), seed=0, train_size=4, test_size=3)
    rows, _ = data_prep.load_prompts(str(tmp_path / "data" / "test.parquet"), tokenizer)
    path = tmp_path / "second_fails.py"
    path.write_text(
        "import os\n"
        "def f(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if extra_info['index'] == 1:\n"
        "        os._exit(0)\n"
        "    return 1.0\n"
    )
    fn = load_reward_fns([f"{path}:f"])

    class Scripted:
        def generate(self, prompts, *, n, **kw):
            return Rollout(
                response_ids=[[tokenizer.eos_token_id]] * (len(prompts) * n), truncated=[False] * (len(prompts) * n)
            )

    kw = dict(n=2, temperature=1.0, max_new_tokens=4, seed=0)
    metrics, samples = validate(Scripted(), rows, tokenizer, fn, {tokenizer.eos_token_id}, errors="skip", **kw)
    assert metrics["val-aux/reward/errors"] == 2  # prompt 1's two samples
    assert [s["score"] for s in samples] == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert "validation, sample 2 of the batch" in capsys.readouterr().err
    with pytest.raises(RewardError, match="validation at step 4, sample 2 of the batch .*exit code 0"):
        validate(Scripted(), rows, tokenizer, fn, {tokenizer.eos_token_id}, where="validation at step 4", **kw)
    fn.close()


# ----------------------------------------------------------------------------------------------
# end to end: the trainer with a reward that calls os._exit(0) on some samples


EXITING = """
import os

def f(data_source, solution_str, ground_truth, extra_info=None):
    # every third prompt; with only_train, the validation prompts score normally
    if extra_info["index"] % 3 == 0 and (extra_info["split"] == "train" or not ONLY_TRAIN):
        os._exit(0)
    return float(solution_str.strip() == ground_truth)
"""

FAST = "--max-steps 2 --test-freq 1 --save-freq -1 --rollout hf --prompt-batch-size 8 --mini-batch-size 8 --group-size 4 --val-max-prompts 8".split()


def train(tmp_path, reward_file, *flags):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_grpo.py"]
    cmd += ["--out-dir", str(tmp_path / "run"), "--reward-fn", f"{reward_file}:f", *FAST, *flags]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_reward_that_calls_os_exit_stops_the_run_with_an_error(tmp_path):
    # what must not happen: exit code 0 (success, to torchrun and schedulers) with no step logged
    reward_file = tmp_path / "exiting.py"
    reward_file.write_text("ONLY_TRAIN = True\n" + EXITING)
    proc = train(tmp_path, reward_file)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "reward function exiting.f, step 1, sample " in proc.stderr
    assert "ended its worker process with exit code 0 (os._exit?)" in proc.stderr
    assert "--reward-errors skip" in proc.stderr


@pytest.mark.slow
def test_with_skip_the_run_completes_and_counts_the_errors_in_training_and_validation(tmp_path):
    reward_file = tmp_path / "exiting.py"
    reward_file.write_text("ONLY_TRAIN = False\n" + EXITING)
    proc = train(tmp_path, reward_file, "--reward-errors", "skip")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    steps = [m for m in lines if m.get("reward/errors") is not None]
    assert [m["step"] for m in steps] == [1, 2] and all(m["reward/errors"] > 0 for m in steps)
    validations = [m for m in lines if "val-aux/reward/errors" in m]
    assert [m["step"] for m in validations] == [0, 1, 2] and all(m["val-aux/reward/errors"] > 0 for m in validations)
    assert "reward errors: " in proc.stderr and "ended its worker process with exit code 0" in proc.stderr
    assert os.path.isdir(tmp_path / "run" / "final_model")


SLOW_ON_RANK_1 = """
import os, time

def slow(data_source, solution_str, ground_truth, extra_info=None):
    if os.environ["RANK"] == "1":  # each call within --reward-timeout, all of them together past --collective-timeout
        time.sleep(5)
    return 0.0
"""


@pytest.mark.slow
def test_the_rank_its_peers_gave_up_on_says_it_was_waiting_on_a_reward_function(tmp_path):
    # rank 0 waits for rank 1 in a collective, gives up after 10 s and says "its own output says why";
    # torchrun then sends rank 1 SIGTERM, and rank 1 says what it is waiting on
    reward_file = tmp_path / "slow.py"
    reward_file.write_text(SLOW_ON_RANK_1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_grpo.py"]
    cmd += ["--out-dir", str(tmp_path / "run"), "--reward-fn", f"{reward_file}:slow", "--rollout", "hf"]
    cmd += "--max-steps 1 --prompt-batch-size 2 --mini-batch-size 2 --group-size 4 --test-freq -1".split()
    cmd += "--no-val-before-train --save-freq -1 --reward-timeout 8 --collective-timeout 10".split()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "another rank stopped answering" in proc.stderr, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if line.startswith("rank 1: SIGTERM came while waiting ")]
    assert len(said) == 1, proc.stdout[-3000:]
    assert said[0].endswith(" s on reward function slow (slow.py), which --reward-timeout allows 8 s"), said
