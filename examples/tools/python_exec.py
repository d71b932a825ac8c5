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
  files        _confine, kernel: in a mount (and, unless root, user) namespace the child sees a private root, a
               tmpfs of DISK_BYTES and DISK_FILES, its one writable place, with Python and READABLE mounted
               read-only. If that is unavailable the tool refuses to run, unless PYTHON_EXEC_UNCONFINED=1 (see there)
Linux only.   Try it:  python examples/tools/python_exec.py 'print(sum(range(10)))'
"""

import functools
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
DISK_BYTES = 16 * 2**20  # all the files it writes together: they live in RAM (a tmpfs)
DISK_FILES = 1000  # files and directories, counting the ~20 the sandbox itself makes
OUTPUT_BYTES = 4096  # stdout+stderr read back; what the model sees is at most this much
MAX_CODE_BYTES = 100_000  # the program travels as one argument, and Linux caps one at 128 KiB
UNPRIVILEGED_UID = 65534  # as root, the code runs as this user and group (nobody/nogroup); None: stays root

# What the code may read besides Python (sys.prefix, sys.base_prefix, sys.path): the shared libraries Python
# and numpy load, the loader's cache, time zones, /etc/hosts and a few devices. Nothing else exists for it.
READABLE = ["/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/share/zoneinfo", "/etc/ld.so.cache", "/etc/localtime"]
READABLE += ["/etc/hosts", "/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"]
# PYTHON_EXEC_UNCONFINED=1 runs the code without _confine where it is unavailable: the code then reads every
# file the trainer's user can, and writes to /tmp and /dev/shm (RAM) with no total limit. An environment
# variable, not a constant here: it says what one machine cannot do, and the launch command shows it.
UNCONFINED_VARIABLE = "PYTHON_EXEC_UNCONFINED"

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

    Each call starts a fresh Python 3 process in an empty directory: variables and files from earlier calls
    are gone. Use print() to show results. The standard library is available, and so are sympy and numpy if
    installed. There are limits on time, memory, files written and output; no subprocesses, threads or network.

    Args:
        code: The complete program, e.g. "import math\\nprint(math.comb(10, 3))".

    Returns:
        What the program printed; if it failed, then also the last line of its error or the limit it hit.
    """
    if why := _refusal():
        raise RuntimeError(why)
    confine = os.environ.get(UNCONFINED_VARIABLE) != "1"
    return _run_python(code, **_limits(), confine=confine)


def _limits():
    """The limits at the top of this file, as _run_python's keyword arguments."""
    return dict(
        cpu_seconds=CPU_SECONDS,
        wall_seconds=WALL_SECONDS,
        memory_bytes=MEMORY_BYTES,
        file_bytes=FILE_BYTES,
        disk_bytes=DISK_BYTES,
        disk_files=DISK_FILES,
        output_bytes=OUTPUT_BYTES,
        uid=UNPRIVILEGED_UID if os.geteuid() == 0 else None,
    )


def _refusal():
    """Why this machine must not run model-written code, or None: _confine is unavailable and the user did
    not opt out with PYTHON_EXEC_UNCONFINED=1."""
    if os.environ.get(UNCONFINED_VARIABLE) == "1" or not (problem := _confinement_problem()):
        return None
    return (
        f"python_exec: refusing to run model-written code that could read this machine's files and fill its"
        f" memory: {problem}. User namespaces may be off here (sysctl user.max_user_namespaces=0,"
        " kernel.unprivileged_userns_clone=0, kernel.apparmor_restrict_unprivileged_userns=1, or a"
        f" container's seccomp profile). {UNCONFINED_VARIABLE}=1 runs it anyway: the code then reads every"
        " file this user can, and writes to /tmp and /dev/shm (RAM) without a total limit"
    )


@functools.cache
def _confinement_problem():
    """None if _confine works on this machine, else why not: one trial call, the first time we are asked."""
    try:
        _run_python("pass", **_limits(), confine=True)
    except RuntimeError as e:
        return str(e)
    return None


def _run_python(
    code,
    *,
    cpu_seconds,
    wall_seconds,
    memory_bytes,
    file_bytes,
    disk_bytes,
    disk_files,
    output_bytes,
    uid=None,
    confine=True,
):
    """`python(code)` with explicit limits (seconds, bytes), the uid to run as (None: ours), and whether to
    _confine its files."""
    if len(code.encode()) > MAX_CODE_BYTES or "\0" in code:
        return f"the program must be at most {MAX_CODE_BYTES} bytes long, with no NUL characters"
    # Confined, the code works in a directory of this name in its private root, and this one stays empty.
    workdir = tempfile.mkdtemp(prefix="python_exec_")
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        limits = [cpu_seconds, memory_bytes, file_bytes, disk_bytes, disk_files, -1 if uid is None else uid]
        process = subprocess.Popen(
            [*PYTHON, os.path.abspath(__file__), "--child", code, *map(str, [*limits, os.getpid(), int(confine)])],
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
    if returncode == SETUP_FAILED and (line := _last_line(stderr)).startswith(SETUP_FAILED_MARK):
        as_root = uid is not None and "confine" not in line
        raise RuntimeError(line + ("; as root, UNPRIVILEGED_UID = None runs the code as root" if as_root else ""))
    disk = f"{disk_bytes / 2**20:g} MiB or {disk_files} files" if confine else None
    note = _explain(returncode, _last_line(stderr), stopped, cpu_seconds, wall_seconds, memory_bytes, file_bytes, disk)
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


def _explain(returncode, error, stopped, cpu_seconds, wall_seconds, memory_bytes, file_bytes, disk):
    """The line the model sees after the output: which limit was hit, or the error's last line (None: success).
    `disk`: the total limit on files, in words (None: there is none)."""
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
    if "[Errno 28]" in error and disk:  # ENOSPC: the tmpfs is full, of bytes or of files
        return f"disk limit of {disk} exceeded ({error})"
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
# The child's side: python -I python_exec.py --child CODE CPU MEMORY FILE DISK FILES UID PARENT_PID CONFINE


def _child(cpu_seconds, memory_bytes, file_bytes, disk_bytes, disk_files, uid, parent_pid, confine):
    """Put the limits on this process, then refuse forks, programs, sockets and ctypes from here on."""
    import ctypes
    import resource

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

    def prctl(option, value):
        if libc.prctl(option, value, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl({option})")

    if confine:
        _confine(libc, disk_bytes, disk_files)
    if uid >= 0:  # we are root: become `uid`, which RLIMIT_NPROC binds
        # Unconfined, we keep CAP_DAC_READ_SEARCH (2): the interpreter and its lazily imported modules may sit
        # where `uid` cannot read (a pyenv or conda under /root). It reads any file; it writes, signals, forks
        # as `uid`. Confined, they are on our new root's path and we keep nothing: that capability would also
        # open any file of a disk by its handle (open_by_handle_at), chroot or not.
        prctl(8, int(not confine))  # PR_SET_KEEPCAPS: keep our capabilities across setuid, to keep one
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        sets = (ctypes.c_uint32 * 6)(*[0 if confine else 1 << 2] * 2)  # effective, permitted, inheritable (x2)
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


def _confine(libc, disk_bytes, disk_files):
    """Hide the machine's files from this process: build a private root filesystem and chroot into it.

    The root is a tmpfs of at most `disk_bytes` and `disk_files` files, the only place the code can write,
    with Python (sys.prefix, sys.base_prefix, sys.path) and READABLE bind-mounted read-only on it; nothing
    else of the machine is there. It is mounted over the working directory, which the code then finds at
    the same path. A mount namespace keeps all this invisible outside and gone with this process; root may
    make one, anyone else first makes a user namespace. Afterwards we keep no capability (root becomes
    UNPRIVILEGED_UID next), so the code can neither mount nor leave the chroot."""
    import ctypes

    def check(result, what):
        if result != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot confine the code's files: {what}: {os.strerror(error)}")

    workdir, uid, gid = os.getcwd(), os.getuid(), os.getgid()
    if uid == 0:
        check(libc.unshare(0x20000), "unshare(CLONE_NEWNS)")
    else:
        check(libc.unshare(0x10000000 | 0x20000), "unshare(CLONE_NEWUSER | CLONE_NEWNS)")
        for name, line in [("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")]:
            with open(f"/proc/self/{name}", "w") as f:  # we stay ourselves: the one mapping we may write
                f.write(line)
    # MS_REC | MS_PRIVATE: else, as root, our mounts would show up outside wherever / is shared (systemd)
    check(libc.mount(None, b"/", None, 0x4000 | 0x40000, None), "mount --make-rprivate /")
    options = f"size={disk_bytes},nr_inodes={disk_files},mode=1777".encode()
    check(libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", 2 | 4, options), "mount a tmpfs")  # nosuid, nodev
    umask = os.umask(0)  # the directories we make are the code's to write in, even as root turned nobody
    read_only = (ctypes.c_uint64 * 4)(1, 0, 0, 0)  # struct mount_attr: attr_set = MOUNT_ATTR_RDONLY
    done = []  # sorted, a directory comes before what is in it, which its mount shows already
    for path in sorted({os.path.abspath(p) for p in [*READABLE, sys.prefix, sys.base_prefix, *sys.path]}):
        if not os.path.exists(path) or any(path.startswith(d + "/") for d in done):
            continue
        target = workdir + path
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()
        check(libc.mount(path.encode(), target.encode(), None, 0x1000 | 0x4000, None), f"bind {path}")  # MS_REC
        # mount_setattr (442 on every architecture), AT_FDCWD, AT_RECURSIVE: its own submounts read-only too
        size = ctypes.c_size_t(ctypes.sizeof(read_only))
        check(
            libc.syscall(ctypes.c_long(442), -100, target.encode(), 0x8000, read_only, size), f"make {path} read-only"
        )
        done.append(path)
    os.makedirs(workdir + workdir)
    os.umask(umask)
    os.chroot(workdir)
    os.chdir(workdir)
    if uid != 0:  # the capabilities the user namespace gave us
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        check(libc.capset(header, (ctypes.c_uint32 * 6)()), "drop capabilities")


# Loaded as a tool (--tools), on a machine that cannot confine the code: the run stops at its start, rather
# than train on a tool whose every call is an error. (The child, run as __main__, does not probe again.)
if __name__ != "__main__" and (_why := _refusal()):
    raise RuntimeError(_why)

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
