"""The worker process that runs --reward-fn (and --tools) functions, so that nothing they do can end the run.

A reward function is the user's code. In the trainer's own process, one that calls sys.exit() would end
the run with exit code 0 (read as success), one that never returns would hang it, and a crash in C code
would kill it. So each rank runs them in one long-lived worker process of its own:

    this process                                   the worker (python reward_worker.py PARENT_PID)
    Worker(loader, setup, timeout)          ---->  loads the user's files itself (functions are never pickled)
    call(requests): the batch, one message  ---->  answers each request in turn (RewardWorker: each sample)
                                            <----  one reply per request: (value, None) or (None, problem)

A request whose function raised, exited, crashed the worker or ran past `timeout` gets a problem instead
of a value (reward.score_responses decides whether that stops the run); the worker is then replaced and
takes the rest of the batch. Module-level state of a user's file lives as long as its worker. The worker
ends when we close it, when its stdin closes, and, on Linux, when this process dies (kill -9 included).
"""

import atexit
import functools
import importlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading

# Loading the user's files may take longer than one call: a file may import torch or sympy.
LOAD_TIMEOUT = 60.0  # seconds, at least

HEADER = struct.Struct("<Q")  # each message on the pipes: its length in bytes, then the pickle

TIMED_OUT = "did not return within"  # how a time-out's problem starts (tools.run_calls tells it apart)

# What a function returns crosses the pipe as a pickle: a value that cannot be pickled there (a lambda,
# an instance of a class defined in the user's file) or loaded here is that request's error.
UNSENDABLE = "returned a value that cannot be sent back from the {} ({}); return numbers, strings, lists or dicts"


def write_message(fd, data):
    """Write one message (bytes) to the pipe `fd`."""
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def read_message(fd):
    """The next message (bytes) on the pipe `fd`; EOFError when the other end closed (or died)."""
    return read_exact(fd, HEADER.unpack(read_exact(fd, HEADER.size))[0])


def read_exact(fd, n):
    # raw os.read, no buffered file objects: poll() must see every byte that has not been read yet
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def how_it_ended(process, what):
    """What a worker (`what`: "reward worker") that stopped answering did, from its exit status."""
    try:
        returncode = process.wait(timeout=5)
    except subprocess.TimeoutExpired:  # it closed its end of the pipe and went on
        return f"closed the {what}'s pipe"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"crashed its worker process ({name}: a crash in C code?)"
    return f"ended its worker process with exit code {returncode} (os._exit?)"


class Worker:
    """Functions from the user's files, run in this process's worker. There `loader` ("module:function",
    a function of this repository) is called with `setup`, loads the files, and returns (answer, info):
    answer(request) -> (value, None) or (None, problem) answers each request, and the first start's
    `info` comes back to us as self.info (tools.py's: the tools' schemas). call(requests) returns one
    (value, problem) per request. The worker starts here, so files that cannot be loaded are an error
    now (RuntimeError, starting with `load_error`), not at the first call. Subclasses name the worker
    in messages."""

    what = "worker"  # how messages call the worker process
    timeout_flag = None  # the flag that sets `timeout`, named in a time-out's problem

    def __init__(self, loader, setup, timeout, load_error):
        self.loader, self.setup, self.timeout, self.load_error = loader, setup, float(timeout), load_error
        self.info, self._process, self._pid = None, None, None
        self._lock = threading.Lock()  # one batch at a time: replies come back in order
        self._start()
        atexit.register(self.close)

    def call(self, requests, stop_on_error=False, timeout=None):
        """[(value, problem)] for `requests`, in order; each gets `timeout` seconds (default self.timeout).
        problem is None, or says what went wrong (then value is None). With stop_on_error, stops after the
        first problem: the list is then shorter than `requests`."""
        results, timeout = [], self.timeout if timeout is None else float(timeout)
        with self._lock:
            try:
                while len(results) < len(requests):
                    if self._process is None or self._pid != os.getpid() or self._process.poll() is not None:
                        self._start()  # none yet, or we are a forked copy, or the last one was stopped or died idle
                    try:
                        write_message(self._process.stdin.fileno(), pickle.dumps(requests[len(results) :]))
                    except OSError:  # it died while we wrote: the reply below finds out how
                        pass
                    self._collect(results, len(requests), stop_on_error, timeout)
                    if stop_on_error and results and results[-1][1] is not None:
                        break
            finally:  # stopped early, or interrupted: its replies to the rest must not answer the next batch
                if len(results) < len(requests):
                    self._stop()
        return results

    @property
    def pid(self):
        """The worker's process id; None while none runs (a new one starts at the next call())."""
        return self._process.pid if self._process is not None else None

    def close(self):
        """Stop the worker (registered with atexit)."""
        self._stop()

    def _collect(self, results, total, stop_on_error, timeout):
        """Read replies into `results` until there are `total`, or the worker failed on one (it is then
        stopped), or, with stop_on_error, a reply reports a problem."""
        while len(results) < total:
            try:
                data = self._reply(timeout)
            except TimeoutError:
                self._stop()
                flag = f" ({self.timeout_flag})" if self.timeout_flag else ""
                results.append((None, f"{TIMED_OUT} {timeout:g} s{flag}; its worker process was killed"))
                return
            except (EOFError, OSError):  # it died
                results.append((None, how_it_ended(self._process, self.what)))
                self._stop()
                return
            try:
                reply = pickle.loads(data)
            except Exception as e:
                reply = (None, UNSENDABLE.format(self.what, f"{type(e).__name__}: {e}"))
            results.append(reply)
            if stop_on_error and reply[1] is not None:
                return

    def _reply(self, timeout):
        """The worker's next message (bytes); TimeoutError if none came within `timeout` seconds."""
        fd = self._process.stdout.fileno()
        waiting = select.poll()  # not select.select: a trainer's file descriptors can pass its limit of 1024
        waiting.register(fd, select.POLLIN)
        if not waiting.poll(timeout * 1000):  # readable, or closed: the worker died
            raise TimeoutError
        return read_message(fd)

    def _start(self):
        self._stop()
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reward_worker.py")
        # its own session: a kill takes down whatever the user's function started too (a code sandbox, say)
        process = subprocess.Popen(
            [sys.executable, script, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            start_new_session=True,
        )
        self._process, self._pid = process, os.getpid()
        load_timeout = max(self.timeout, LOAD_TIMEOUT)
        try:
            write_message(process.stdin.fileno(), pickle.dumps((self.loader, self.setup, self.what)))
            status, said = pickle.loads(self._reply(load_timeout))  # ("ready", info) or ("failed", problem)
        except TimeoutError:
            status, said = "failed", f"did not finish loading within {load_timeout:g} s"
        except (EOFError, OSError):  # it died
            status, said = "failed", f"{how_it_ended(process, self.what)} while loading; its output is above"
        if status != "ready":
            self._stop()
            raise RuntimeError(f"{self.load_error}: {said}")
        self.info = said if self.info is None else self.info  # the first start's: a restart may skip work

    def _stop(self):
        process, self._process = self._process, None
        if process is None or self._pid != os.getpid():  # none, or our parent's (we are a forked copy)
            return
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        process.wait()
        process.stdin.close()
        process.stdout.close()


class RewardWorker(Worker):
    """Reward functions ('path/to/file.py:function' specs, summed with `weights` as reward.load_reward_fns
    does) run in this process's worker: score() returns one (score, extras, problem) per sample. `name`
    is how error messages call them."""

    what, timeout_flag = "reward worker", "--reward-timeout"

    def __init__(self, specs, weights=None, timeout=300.0, name="reward function"):
        self.specs, self.weights, self.__name__ = list(specs), weights, name
        load_error = f"--reward-fn {','.join(self.specs)}: could not load the reward functions"
        super().__init__("reward_worker:load_rewards", (self.specs, weights), timeout, load_error)

    def score(self, samples, stop_on_error=False):
        """[(score, extras, problem)] for samples [(data_source, solution_str, ground_truth, extra_info)], in
        order. problem is None, or says what went wrong (then score and extras are None). With stop_on_error,
        stops after the first problem: the list is then shorter than `samples`."""
        results = self.call(samples, stop_on_error)
        return [(None, None, problem) if problem is not None else (*value, None) for value, problem in results]


# ----------------------------------------------------------------------------------------------
# The worker's side


def die_with_parent(parent_pid):
    """Have the kernel kill this process when the process that started it dies, kill -9 included, even
    during a call that never returns (Linux's PR_SET_PDEATHSIG; strictly, when the thread that started it
    ends: a worker started from a short-lived thread is restarted by the next score()). Elsewhere, a
    dead parent ends the worker between calls only, when its stdin closes."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # it died before that took effect
        os._exit(1)


def load_rewards(setup):
    """The reward worker's loader (Worker): the reward function of (specs, weights), and its answer to a
    sample: ((score, extras), None) or (None, problem), as reward.score_one scores it."""
    import reward  # here, not at the top: reward imports this module

    return functools.partial(answer_reward, reward.load_reward_fns_in_process(*setup)), None


def answer_reward(fn, sample):
    import reward

    score, extras, problem = reward.score_one(fn, *sample)
    return (None, problem) if problem is not None else ((score, extras), None)


def serve(parent_pid):
    """The worker's loop. The first message is (loader, setup, what): loader(setup) returns (answer, info);
    then each message is a batch of requests, and each request gets one reply, answer(request). Ends when
    stdin closes."""
    requests, replies = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # what a user's function prints goes to stderr, not into our replies
    die_with_parent(parent_pid)
    from reward import describe

    loader, setup, what = pickle.loads(read_message(requests))
    module, _, function = loader.partition(":")
    try:
        answer, info = getattr(importlib.import_module(module), function)(setup)
    except BaseException as e:  # a syntax error, a missing function, a sys.exit at import: all reported
        write_message(replies, pickle.dumps(("failed", describe(e))))
        return
    write_message(replies, pickle.dumps(("ready", info)))
    while True:
        try:
            batch = pickle.loads(read_message(requests))
        except EOFError:
            return
        for request in batch:
            try:
                result = answer(request)
            except BaseException as e:  # what answer lets through (KeyboardInterrupt) is this request's too
                result = (None, describe(e))
            try:
                data = pickle.dumps(result)
            except Exception as e:
                data = pickle.dumps((None, UNSENDABLE.format(what, f"{type(e).__name__}: {e}")))
            write_message(replies, data)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
