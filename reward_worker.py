"""The worker process that runs --reward-fn (and --tools) functions, so that nothing they do can end the run.

A reward function is the user's code. In the trainer's own process, one that calls sys.exit() would end
the run with exit code 0 (read as success), one that never returns would hang it, and a crash in C code
would kill it. So each rank runs them in one long-lived worker process of its own:

    this process                                   the worker (python reward_worker.py PARENT_PID)
    Worker(loader, setup, timeout)          ---->  loads the user's files itself (functions are never pickled)
    call(requests): the batch, one message  ---->  answers each request in turn (reward.RewardWorker: each sample)
                                            <----  one reply per request: (value, None) or (None, problem)

A request whose function raised, exited, crashed the worker or ran past `timeout` gets a problem instead of a
value (reward.score_responses decides if that stops the run); the worker is replaced, with all its functions
started (kill_tree), and takes the rest of the batch. Module-level state lives until we close it, its stdin
closes, or (Linux) this process dies, kill -9 included. Prints: OUTPUT_CAP; a stuck rank's wait: waits()."""

import atexit
import importlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time

from user_errors import describe

# Loading the user's files may take longer than one call: a file may import torch or sympy.
LOAD_TIMEOUT = 60.0  # seconds, at least

HEADER = struct.Struct("<Q")  # each message on the pipes: its length in bytes, then the pickle

TIMED_OUT = "did not return within"  # how a time-out's problem starts (tools.run_calls tells it apart)

# What a function returns crosses the pipe as a pickle: a value that cannot be pickled there (a lambda,
# an instance of a class defined in the user's file) or loaded here is that request's error.
UNSENDABLE = "returned a value that cannot be sent back from the {} ({}); return numbers, strings, lists or dicts"

# What one call may print (stdout and stderr together) into our stderr: a tool that prints 200 MB must not
# fill the run's log. The rest is dropped, with a note; tools.run_calls counts such a call as truncated.
OUTPUT_CAP = 64 * 1024  # bytes

# Each worker and every process it starts carry MARK=<this worker's own value> in their environment, by
# which kill_tree finds the ones that left the worker's session (setsid) or its process tree (a double fork).
MARK = "REWARD_WORKER_MARK"


def end_mark(mark):
    """What the worker writes to its stderr after each request's prints, before its reply: their prints and its
    replies come on two pipes, so timing cannot tell which request printed what; this line between them can."""
    return f"\0{mark}: end of a request\0".encode()


_waiting = {}  # id(worker) -> (what it runs, since when: time.monotonic(), its timeout, the flag that sets it)


def waits():
    """What this process waits on now, one line per Worker in a call, e.g. "waiting 61 s on reward function f
    (my_reward.py), which --reward-timeout allows 300 s". A rank stopped by a signal prints them
    (distributed.catch_stop_signals): its peers gave up on it, and they say that its own output says why."""
    now = time.monotonic()
    return [
        f"waiting {now - since:.0f} s on {what}, which {flag or 'its timeout'} allows {timeout:g} s"
        for what, since, timeout, flag in list(_waiting.values())
    ]


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
    (value, problem) per request, and self.dropped the bytes each printed past OUTPUT_CAP. The worker starts
    here, so files that cannot be loaded are an error now (RuntimeError, starting with `load_error`), not at
    the first call. Subclasses name the worker, and what a request runs (waiting_on), in messages."""

    what = "worker"  # how messages call the worker process
    timeout_flag = None  # the flag that sets `timeout`, named in a time-out's problem

    def __init__(self, loader, setup, timeout, load_error):
        self.loader, self.setup, self.timeout, self.load_error = loader, setup, float(timeout), load_error
        self.info, self._process, self._pid, self._mark, self.dropped = None, None, None, None, []
        self._printed = 0  # bytes the request now running printed so far (_pass_on)
        self._ended, self._held = False, b""  # its end mark read; what we read after it, or a mark's first bytes
        self._lock = threading.Lock()  # one batch at a time: replies come back in order
        self._start()
        atexit.register(self.close)

    def call(self, requests, stop_on_error=False, timeout=None):
        """[(value, problem)] for `requests`, in order; each gets `timeout` seconds (default self.timeout).
        problem is None, or says what went wrong (then value is None). With stop_on_error, stops after the
        first problem: the list is then shorter than `requests`."""
        results, timeout = [], self.timeout if timeout is None else float(timeout)
        with self._lock:
            self.dropped = []
            try:
                while len(results) < len(requests):
                    if self._process is None or self._pid != os.getpid() or self._process.poll() is not None:
                        self._start()  # none yet, or we are a forked copy, or the last one was stopped or died idle
                    try:
                        write_message(self._process.stdin.fileno(), pickle.dumps(requests[len(results) :]))
                    except OSError:  # it died while we wrote: the reply below finds out how
                        pass
                    self._collect(results, requests, stop_on_error, timeout)
                    if stop_on_error and results and results[-1][1] is not None:
                        break
            finally:  # stopped early, or interrupted: its replies to the rest must not answer the next batch
                _waiting.pop(id(self), None)
                if len(results) < len(requests):
                    self._stop()
        return results

    def waiting_on(self, request):
        """What `request` runs, as waits() names it."""
        return f"the {self.what}"

    @property
    def pid(self):
        """The worker's process id; None while none runs (a new one starts at the next call())."""
        return self._process.pid if self._process is not None else None

    def close(self):
        """Stop the worker (registered with atexit)."""
        self._stop()

    def _collect(self, results, requests, stop_on_error, timeout):
        """Read replies into `results` until there is one per request, or the worker failed on one (it is
        then stopped), or, with stop_on_error, a reply reports a problem."""
        while len(results) < len(requests):
            _waiting[id(self)] = (self.waiting_on(requests[len(results)]), time.monotonic(), timeout, self.timeout_flag)
            try:
                data = self._reply(timeout)
            except TimeoutError:
                self._stop()
                flag = f" ({self.timeout_flag})" if self.timeout_flag else ""
                self._answered(results, (None, f"{TIMED_OUT} {timeout:g} s{flag}; its worker process was killed"))
                return
            except (EOFError, OSError):  # it died
                problem = how_it_ended(self._process, self.what)
                self._stop()
                self._answered(results, (None, problem))
                return
            try:
                reply = pickle.loads(data)
            except Exception as e:
                reply = (None, UNSENDABLE.format(self.what, f"{type(e).__name__}: {e}"))
            self._answered(results, reply)
            if stop_on_error and reply[1] is not None:
                return

    def _answered(self, results, reply):
        results.append(reply)
        self.dropped.append(self._past_cap())

    def _past_cap(self):
        """The bytes that the request just ended printed past OUTPUT_CAP (dropped, with a note); the next
        request's count starts at 0."""
        dropped, self._printed, self._ended = max(self._printed - OUTPUT_CAP, 0), 0, False
        if dropped:
            say(
                f"\n[{self.what}: one call printed {dropped + OUTPUT_CAP:,} bytes; the first {OUTPUT_CAP:,} are above, the rest was dropped]\n"
            )
        self._take(b"")  # what the worker printed after this request's end mark: the next one's
        return dropped

    def _reply(self, timeout):
        """The worker's next message (bytes); TimeoutError if none came within `timeout` seconds. What it
        prints meanwhile goes on to our stderr (_pass_on)."""
        fd, printed = self._process.stdout.fileno(), self._process.stderr.fileno()
        waiting = select.poll()  # not select.select: a trainer's file descriptors can pass its limit of 1024
        waiting.register(fd, select.POLLIN)
        waiting.register(printed, select.POLLIN)
        deadline = time.monotonic() + timeout
        while True:
            ready = {f for f, _ in waiting.poll(max(deadline - time.monotonic(), 0.0) * 1000)}
            if fd in ready:  # readable, or closed: the worker died
                self._pass_on(self._process)  # to the request's end mark, which the worker wrote before its reply
                return read_message(fd)
            if printed in ready and not self._pass_on(self._process):
                waiting.unregister(printed)  # closed: the worker died, or closed its stderr
            if time.monotonic() >= deadline:
                raise TimeoutError

    def _pass_on(self, process, to_the_end=False):
        """Pass what `process` printed, as much as its pipe holds now up to the running request's end mark (all of
        it, marks dropped, `to_the_end`), on to our stderr while this request printed at most OUTPUT_CAP bytes,
        and count it. False once the pipe is closed (and empty)."""
        for _ in range(64):  # at most 4 MiB at a time: one that never stops printing must not hold us here
            if self._ended and not to_the_end:  # the rest is the next request's: _past_cap takes it
                return True
            try:
                data = os.read(process.stderr.fileno(), 1 << 16)
            except BlockingIOError:  # empty for now
                return True
            if not data:
                return False
            self._take(data, to_the_end)
        return True

    def _take(self, data, to_the_end=False):
        """Count and pass on `data`, printed by the worker, up to the running request's end mark: what follows it
        is held for the next request, and so are a last few bytes that may be the start of a mark."""
        data, mark = self._held + data, end_mark(self._mark)
        end = -1 if to_the_end else data.find(mark)
        if end != -1:
            data, self._held, self._ended = data[:end], data[end + len(mark) :], True
        else:  # a mark that the pipe split starts with its first byte, "\0", and has no other before its last
            start = data.rfind(b"\0")
            split = start != -1 and mark.startswith(data[start:]) and not to_the_end
            data, self._held = (data[:start], data[start:]) if split else (data.replace(mark, b""), b"")
        say(data[: max(OUTPUT_CAP - self._printed, 0)])
        self._printed += len(data)

    def _start(self):
        self._stop()
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reward_worker.py")
        # its own session, and its MARK: a kill takes down whatever the user's function started too (kill_tree)
        mark = f"{os.getpid()}.{os.urandom(8).hex()}"
        process = subprocess.Popen(
            [sys.executable, script, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,  # what its functions print: we pass it on (_pass_on)
            bufsize=0,
            start_new_session=True,
            env={**os.environ, MARK: mark},
        )
        os.set_blocking(process.stderr.fileno(), False)
        self._process, self._pid, self._mark, self._printed = process, os.getpid(), mark, 0
        self._ended, self._held = False, b""
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
            self._past_cap()
            raise RuntimeError(f"{self.load_error}: {said}")
        self._past_cap()
        self.info = said if self.info is None else self.info  # the first start's: a restart may skip work

    def _stop(self):
        process, self._process = self._process, None
        if process is None or self._pid != os.getpid():  # none, or our parent's (we are a forked copy)
            return
        kill_tree(process.pid, self._mark, self.what)
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # where there is no /proc, its process group at least
            except ProcessLookupError:
                pass
        process.wait()
        self._pass_on(process, to_the_end=True)  # what it printed before it ended
        process.stdin.close()
        process.stdout.close()
        process.stderr.close()


def say(data):
    """Write `data` (bytes or text) to our stderr, all of it: os.write, as the worker's output came."""
    view = memoryview(data.encode() if isinstance(data, str) else data)
    try:
        while view:
            view = view[os.write(2, view) :]
    except OSError:  # our stderr is gone: nobody to tell
        pass


def kill_tree(pid, mark, what):
    """SIGKILL the worker `pid` and every process it started, even one that called setsid (a process-group
    kill misses it) or was orphaned by a double fork (its parent is no longer the worker): each live process
    that descends from `pid` or carries MARK=`mark` in its environment. Again until none is left, as one may
    start another while we look. Linux only (/proc). What escapes: a process that both left the tree and
    cleared its environment; only a cgroup would hold that one, and we cannot count on having one."""
    if not os.path.isdir("/proc"):
        return
    entry, deadline = f"\0{MARK}={mark}\0".encode(), time.monotonic() + 10
    while found := ours(pid, entry) - {os.getpid()}:
        for p in found:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:  # it ended meanwhile
                pass
        if time.monotonic() > deadline:  # in uninterruptible sleep (a hung mount?): say so, never hang
            say(f"{what}: processes {sorted(found)}, started by its functions, survive SIGKILL\n")
            return
        time.sleep(0.01)


def ours(pid, entry):
    """The live processes that descend from `pid` or whose environment holds `entry` ("\\0MARK=value\\0"),
    and theirs."""
    parents, roots = {}, {pid}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state, parent = f.read().rsplit(b")", 1)[1].split()[:2]
            if state in (b"Z", b"X"):  # dead, waiting for its parent to reap it
                continue
            parents[int(name)] = int(parent)
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry in b"\0" + f.read():
                    roots.add(int(name))
        except OSError:  # it ended meanwhile, or is not ours to read
            continue
    found = roots & set(parents)
    while more := {p for p, parent in parents.items() if parent in found} - found:
        found |= more
    return found


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
    """The worker's loop. The first message is (loader, setup, what): loader(setup) returns (answer, info);
    then each message is a batch of requests, and each request gets one reply, answer(request). Ends when
    stdin closes."""
    requests, replies = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # what a user's function prints goes to stderr (a pipe the caller reads), not into our replies
    die_with_parent(parent_pid)
    loader, setup, what = pickle.loads(read_message(requests))
    module, _, function = loader.partition(":")
    try:
        answer, info = getattr(importlib.import_module(module), function)(setup)
    except BaseException as e:  # a syntax error, a missing function, a sys.exit at import: all reported
        end_request()
        write_message(replies, pickle.dumps(("failed", describe(e))))
        return
    end_request()
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
            end_request()
            write_message(replies, data)


def end_request():
    """What a request printed is all out, followed by its end mark (end_mark), before its reply is sent."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # closed, or replaced by the user's code with something that cannot
            pass
    try:
        os.write(2, end_mark(os.environ.get(MARK, "")))
    except OSError:  # the user's code closed our stderr: the caller counts what it read
        pass


if __name__ == "__main__":
    serve(int(sys.argv[1]))
