"""A `python` tool for GRPO: run model-written Python code in a child process with limits, return what it printed.

Which layer stops what (docs/sandbox.md says what none of them stop):
  CPU time     RLIMIT_CPU, kernel: SIGXCPU after CPU_SECONDS, SIGKILL one second later
  wall clock   this process kills the child's process group after WALL_SECONDS (a sleep uses no CPU)
  memory       RLIMIT_AS, kernel: an allocation past MEMORY_BYTES fails (MemoryError)
  file size    RLIMIT_FSIZE, kernel: a write past FILE_BYTES fails (OSError EFBIG); per file, not in total
  output       this process reads at most OUTPUT_BYTES of stdout+stderr, then kills the process group
  forks        an audit hook refuses os.fork/system/exec/posix_spawn, subprocess and ctypes with a clear
               message; a determined program gets past it (a C extension), so RLIMIT_NPROC = 0 stops every
               new process and thread in the kernel. That limit does not bind root, so as root the child
               first becomes UNPRIVILEGED_UID, keeping only the capability to read any file
  network      the audit hook refuses to make sockets: Python-level only, no kernel layer
  environment  the child gets an empty environment (-I also ignores PYTHON* variables)
  files        the child works in a fresh temporary directory, removed afterwards
Linux only.   Try it:  python examples/tools/python_exec.py 'print(sum(range(10)))'
"""

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# The limits of one call: edit these for your run (the tool reads them at each call).
CPU_SECONDS = 5
WALL_SECONDS = 10
MEMORY_BYTES = 256 * 2**20  # address space: `import numpy` alone takes ~130 MiB of it, `import torch` does not fit
FILE_BYTES = 1 * 2**20  # the largest file the code may write
OUTPUT_BYTES = 4096  # stdout+stderr read back; what the model sees is at most this much
MAX_CODE_BYTES = 100_000  # the program travels as one argument, and Linux caps one at 128 KiB
UNPRIVILEGED_UID = 65534  # as root, the code runs as this user and group (nobody/nogroup); None: stays root

# -I (isolated): no PYTHON* variables, no user site-packages, neither the script's directory nor the cwd on
# sys.path. Not -S: that would also drop site-packages, and models solving math reach for sympy and numpy.
# -X utf8: text I/O is UTF-8 whatever the locale (the empty environment has none).
PYTHON = [sys.executable, "-I", "-X", "utf8"]

FORK_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.system", "subprocess.Popen", "pty.spawn"}
REFUSED = {"os.exec": "running other programs is not allowed", "socket.__new__": "network access is not allowed"}
REFUSED |= {event: "forking is not allowed" for event in FORK_EVENTS}
REFUSED |= {"ctypes.dlopen": "ctypes is not allowed", "ctypes.dlsym": "ctypes is not allowed"}

# The child's exit status and the start of its last line on stderr when it could not put a limit in place:
# the tool then raises, rather than run the code with fewer limits than you set.
SETUP_FAILED, SETUP_FAILED_MARK = 121, "python_exec setup failed:"


def python(code: str) -> str:
    """Run a Python program and return what it printed.

    Each call starts a fresh Python 3 process in an empty directory: variables from earlier calls are gone.
    Use print() to show results. The standard library is available, and so are sympy and numpy if installed.
    There are limits on time, memory, file size and output; no subprocesses, threads or network.

    Args:
        code: The complete program, e.g. "import math\\nprint(math.comb(10, 3))".

    Returns:
        What the program printed; if it failed, then also the last line of its error or the limit it hit.
    """
    return _run_python(
        code,
        cpu_seconds=CPU_SECONDS,
        wall_seconds=WALL_SECONDS,
        memory_bytes=MEMORY_BYTES,
        file_bytes=FILE_BYTES,
        output_bytes=OUTPUT_BYTES,
        uid=UNPRIVILEGED_UID if os.geteuid() == 0 else None,
    )


def _run_python(code, *, cpu_seconds, wall_seconds, memory_bytes, file_bytes, output_bytes, uid=None):
    """`python(code)` with explicit limits (seconds, bytes) and the uid to run as (None: ours)."""
    if len(code.encode()) > MAX_CODE_BYTES or "\0" in code:
        return f"the program must be at most {MAX_CODE_BYTES} bytes long, with no NUL characters"
    workdir = tempfile.mkdtemp(prefix="python_exec_")
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        limits = [str(n) for n in (cpu_seconds, memory_bytes, file_bytes, -1 if uid is None else uid, os.getpid())]
        process = subprocess.Popen(
            [*PYTHON, os.path.abspath(__file__), "--child", code, *limits],
            cwd=workdir,
            # Nothing of ours: API keys and tokens often live in the environment. One thread for OpenBLAS and
            # OpenMP, which would otherwise fail to start their threads (RLIMIT_NPROC) and fail `import numpy`;
            # tempfile's files go into the working directory, which we remove, not into /tmp.
            env={"OMP_NUM_THREADS": "1", "TMPDIR": workdir},
            stdin=subprocess.DEVNULL,  # input() gets EOFError
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, so one killpg ends it and anything it started
        )
        stdout, stderr, stopped = _read_limited(process, output_bytes, deadline=time.monotonic() + wall_seconds)
        # Not reaped yet, the child holds its process-group id: no new group can have taken it.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        returncode = process.wait()
    finally:
        _remove_tree(workdir)
    if returncode == SETUP_FAILED and _last_line(stderr).startswith(SETUP_FAILED_MARK):
        raise RuntimeError(f"{_last_line(stderr)}; as root, UNPRIVILEGED_UID = None runs the code as root")
    note = _explain(returncode, _last_line(stderr), stopped, cpu_seconds, wall_seconds, memory_bytes, file_bytes)
    if stopped == "output":
        note = f"output truncated after {output_bytes} bytes"
    text = stdout[:output_bytes].decode("utf-8", errors="replace")
    if note and text and not text.endswith("\n"):
        text += "\n"
    return text + (note or "")


def _read_limited(process, output_bytes, deadline):
    """Read the child's stdout and stderr until it has exited and both pipes have closed, more than
    `output_bytes` came in all, or the deadline (time.monotonic()) passed. The child is left unreaped.
    Returns (stdout, stderr, stopped): stopped is "output", "wall" or None."""
    out, err = process.stdout.fileno(), process.stderr.fileno()
    exited = os.pidfd_open(process.pid)  # becomes readable when the child exits
    chunks = {out: [], err: []}
    selector = selectors.DefaultSelector()
    for fd in (out, err, exited):
        selector.register(fd, selectors.EVENT_READ)
    total, stopped = 0, None
    while selector.get_map() and not stopped:
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            stopped = "wall"
        for key, _ in selector.select(max(timeout, 0)):
            chunk = b"" if key.fd == exited else os.read(key.fd, 65536)
            if not chunk:  # exited, or a pipe closed
                selector.unregister(key.fd)
                continue
            chunks[key.fd].append(chunk)
            total += len(chunk)
        if total > output_bytes:
            stopped = "output"
    selector.close()
    os.close(exited)
    process.stdout.close()
    process.stderr.close()
    return b"".join(chunks[out]), b"".join(chunks[err]), stopped


def _explain(returncode, error, stopped, cpu_seconds, wall_seconds, memory_bytes, file_bytes):
    """The line the model sees after the output: which limit was hit, or the error's last line (None: success)."""
    if stopped == "wall":
        return f"time limit of {wall_seconds:g} s exceeded (wall clock)"
    # a SIGKILL we did not send: RLIMIT_CPU's hard limit (the code caught SIGXCPU), or the kernel's OOM killer
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return f"time limit of {cpu_seconds:g} s exceeded (CPU time)"
    if returncode < 0:
        return f"the program was killed by {signal.Signals(-returncode).name}"
    if returncode == 0:
        return None
    if "MemoryError" in error:
        return f"memory limit of {memory_bytes / 2**20:g} MiB exceeded ({error})"
    if "[Errno 27]" in error:  # EFBIG
        return f"file size limit of {file_bytes / 2**20:g} MiB exceeded ({error})"
    return error or f"exit status {returncode}"


def _last_line(data):
    lines = data.decode("utf-8", errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


def _remove_tree(path):
    """shutil.rmtree, after making every directory ours to empty: the code may have chmod-ed one to 0."""
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o700)
    shutil.rmtree(path)


# ----------------------------------------------------------------------------------------------
# The child's side: python -I examples/tools/python_exec.py --child CODE CPU MEMORY FILE UID PARENT_PID


def _child(cpu_seconds, memory_bytes, file_bytes, uid, parent_pid):
    """Put the limits on this process, then refuse forks, programs, sockets and ctypes from here on."""
    import ctypes
    import resource

    libc = ctypes.CDLL(None, use_errno=True)

    def prctl(option, value):
        if libc.prctl(option, value, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl({option})")

    if uid >= 0:  # we are root: become `uid`, which RLIMIT_NPROC binds
        prctl(8, 1)  # PR_SET_KEEPCAPS: keep our capabilities across setuid, so that we can keep one of them
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        # Only CAP_DAC_READ_SEARCH (2): the interpreter and its lazily imported modules may sit where `uid`
        # cannot read (a pyenv or conda under /root). It reads any file; it writes, signals, forks as `uid`.
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        sets = (ctypes.c_uint32 * 6)(1 << 2, 1 << 2, 0, 0, 0, 0)  # effective, permitted, inheritable (x2)
        if libc.capset(header, sets) != 0:
            raise OSError(ctypes.get_errno(), "capset")
    prctl(38, 1)  # PR_SET_NO_NEW_PRIVS: an exec of a setuid program cannot make us root again
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the trainer, even kill -9-ed, even mid-sleep
    if os.getppid() != parent_pid:
        raise RuntimeError("the trainer died before PR_SET_PDEATHSIG took effect")
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # no new process or thread: we count already
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would otherwise dump core into the cwd

    refused = dict(REFUSED)  # a copy: the code can reach this module's REFUSED as sys.modules["__main__"]

    def refuse(event, args):  # an audit hook cannot be removed once added
        if event in refused:
            raise PermissionError(f"{refused[event]} ({event})")

    sys.addaudithook(refuse)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        code = sys.argv[2]
        try:
            _child(*map(int, sys.argv[3:]))
        except Exception as e:
            print(f"{SETUP_FAILED_MARK} {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(SETUP_FAILED)
        import traceback  # now: after a MemoryError there may be no memory left to import it

        sys.argv = ["-c"]
        try:
            exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        except Exception as e:  # only its last line: a long traceback would use up OUTPUT_BYTES
            print(traceback.format_exception_only(e)[-1], end="", file=sys.stderr)
            sys.exit(1)
    else:
        print(python(sys.argv[1]))
