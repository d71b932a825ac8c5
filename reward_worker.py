"""The worker process that runs --reward-fn functions, so that nothing a reward function does can end the run.

A reward function is the user's code. In the trainer's own process, one that calls sys.exit() would end
the run with exit code 0 (read as success), one that never returns would hang it, and a crash in C code
would kill it. So each rank runs them in one long-lived worker process of its own:

    this process                                   the worker (python reward_worker.py PARENT_PID)
    RewardWorker(specs, weights, timeout)   ---->  loads the reward files itself (functions are never pickled)
    score(samples): the batch, one message  ---->  calls the reward function on each sample in turn
                                            <----  one reply per sample: (score, extras, None) or (.., problem)

A sample whose function raised, exited, crashed the worker or ran past `timeout` gets a problem instead
of a score (reward.score_responses decides whether that stops the run); the worker is then replaced and
takes the rest of the batch. Module-level state of a reward file lives as long as its worker. The worker
ends when we close it, when its stdin closes, and, on Linux, when this process dies (kill -9 included).
"""

import atexit
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading

# Loading the reward files may take longer than one call: a file may import torch or sympy.
LOAD_TIMEOUT = 60.0  # seconds, at least

HEADER = struct.Struct("<Q")  # each message on the pipes: its length in bytes, then the pickle


# What a reward returns crosses the pipe as a pickle: a value that cannot be pickled there (a lambda,
# an instance of a class defined in the reward file) or loaded here is that sample's reward error.
UNSENDABLE = (
    "returned a value that cannot be sent back from the reward worker ({}); return numbers, strings, lists or dicts"
)


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


def how_it_ended(process):
    """What a worker that stopped answering did, from its exit status."""
    try:
        returncode = process.wait(timeout=5)
    except subprocess.TimeoutExpired:  # it closed its end of the pipe and went on
        return "closed the reward worker's pipe"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"crashed its worker process ({name}: a crash in C code?)"
    return f"ended its worker process with exit code {returncode} (os._exit?)"


class RewardWorker:
    """Reward functions ('path/to/file.py:function' specs, summed with `weights` as reward.load_reward_fns
    does) run in this process's worker: score() returns one (score, extras, problem) per sample. `name`
    is how error messages call them. The worker starts here, so a file that cannot be loaded is an error
    now (RuntimeError), not at the first step."""

    def __init__(self, specs, weights=None, timeout=300.0, name="reward function"):
        self.specs, self.weights, self.timeout = list(specs), weights, float(timeout)
        self.__name__ = name
        self._process, self._pid = None, None
        self._lock = threading.Lock()  # one batch at a time: replies come back in order
        self._start()
        atexit.register(self.close)

    def score(self, samples, stop_on_error=False):
        """[(score, extras, problem)] for samples [(data_source, solution_str, ground_truth, extra_info)], in
        order. problem is None, or says what went wrong (then score and extras are None). With stop_on_error,
        stops after the first problem: the list is then shorter than `samples`."""
        results = []
        with self._lock:
            try:
                while len(results) < len(samples):
                    if self._process is None or self._pid != os.getpid() or self._process.poll() is not None:
                        self._start()  # none yet, or we are a forked copy, or the last one was stopped or died idle
                    try:
                        write_message(self._process.stdin.fileno(), pickle.dumps(samples[len(results) :]))
                    except OSError:  # it died while we wrote: the reply below finds out how
                        pass
                    self._collect(results, len(samples), stop_on_error)
                    if stop_on_error and results and results[-1][2] is not None:
                        break
            finally:  # stopped early, or interrupted: its replies to the rest must not answer the next batch
                if len(results) < len(samples):
                    self._stop()
        return results

    @property
    def pid(self):
        """The worker's process id; None while none runs (a new one starts at the next score())."""
        return self._process.pid if self._process is not None else None

    def close(self):
        """Stop the worker (registered with atexit)."""
        self._stop()

    def _collect(self, results, total, stop_on_error):
        """Read replies into `results` until there are `total`, or the worker failed on one (it is then
        stopped), or, with stop_on_error, a reply reports a problem."""
        while len(results) < total:
            try:
                data = self._reply(self.timeout)
            except TimeoutError:
                self._stop()
                seconds = f"{self.timeout:g} s (--reward-timeout)"
                results.append((None, None, f"did not return within {seconds}; its worker process was killed"))
                return
            except (EOFError, OSError):  # it died
                results.append((None, None, how_it_ended(self._process)))
                self._stop()
                return
            try:
                reply = pickle.loads(data)
            except Exception as e:
                reply = (None, None, UNSENDABLE.format(f"{type(e).__name__}: {e}"))
            results.append(reply)
            if stop_on_error and reply[2] is not None:
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
        # its own session: a kill takes down whatever the reward function started too (a code sandbox, say)
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
            write_message(process.stdin.fileno(), pickle.dumps((self.specs, self.weights)))
            status, problem = pickle.loads(self._reply(load_timeout))
        except TimeoutError:
            status, problem = "failed", f"did not finish loading within {load_timeout:g} s"
        except (EOFError, OSError):  # it died
            status, problem = "failed", f"{how_it_ended(process)} while loading; its output is above"
        if status != "ready":
            self._stop()
            raise RuntimeError(f"--reward-fn {','.join(self.specs)}: could not load the reward functions: {problem}")

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


def serve(parent_pid):
    """The worker's loop. The first message is (specs, weights); then each message is a batch of samples,
    and each sample gets one reply. Ends when stdin closes."""
    requests, replies = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # what a reward function prints goes to stderr, not into our replies
    die_with_parent(parent_pid)
    import reward

    specs, weights = pickle.loads(read_message(requests))
    try:
        fn = reward.load_reward_fns_in_process(specs, weights)
    except BaseException as e:  # a syntax error, a missing function, a sys.exit at import: all reported
        write_message(replies, pickle.dumps(("failed", reward.describe(e))))
        return
    write_message(replies, pickle.dumps(("ready", None)))
    while True:
        try:
            batch = pickle.loads(read_message(requests))
        except EOFError:
            return
        for sample in batch:
            try:
                result = reward.score_one(fn, *sample)
            except BaseException as e:  # what score_one lets through (KeyboardInterrupt) is this sample's too
                result = (None, None, reward.describe(e))
            try:
                data = pickle.dumps(result)
            except Exception as e:
                data = pickle.dumps((None, None, UNSENDABLE.format(f"{type(e).__name__}: {e}")))
            write_message(replies, data)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
