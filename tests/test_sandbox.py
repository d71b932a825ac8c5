"""examples/tools/python_exec.py: the `python` tool runs model-written code in a child process and
returns what it printed, or the limit it hit. Each test puts small limits on one call (run() below),
so a runaway program costs a second or two. As root, the code runs as nobody (UNPRIVILEGED_UID)."""

import importlib.util
import os
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox uses Linux's limits")

PATH = os.path.join(os.path.dirname(__file__), "..", "examples", "tools", "python_exec.py")
spec = importlib.util.spec_from_file_location("python_exec", PATH)
python_exec = importlib.util.module_from_spec(spec)
spec.loader.exec_module(python_exec)


def run(code, **limits):
    """_run_python with small limits; a keyword overrides one of them."""
    limits = {
        "cpu_seconds": 1,
        "wall_seconds": 6,  # well past 1 s of CPU even on a busy 2-core machine
        "memory_bytes": 256 * 2**20,
        "file_bytes": 2**20,
        "output_bytes": 1000,
        "uid": python_exec.UNPRIVILEGED_UID if os.geteuid() == 0 else None,
    } | limits
    return python_exec._run_python(code, **limits)


def test_prints_its_result():
    assert python_exec.python("import math\nprint(math.comb(10, 3))") == "120\n"
    assert run("x = 2 + 2") == ""  # nothing printed, nothing returned: the tool's docstring says to print()


def test_an_error_gives_its_last_line_after_the_output():
    assert run("print('before')\n1 / 0") == "before\nZeroDivisionError: division by zero"
    assert run("def f(:") == "SyntaxError: invalid syntax"
    assert run("import sys\nsys.exit(3)") == "exit status 3"
    assert run("input()") == "EOFError: EOF when reading a line"  # stdin is /dev/null


def test_an_infinite_loop_hits_the_cpu_time_limit():
    assert run("while True: pass") == "time limit of 1 s exceeded (CPU time)"


def test_sleeping_hits_the_wall_clock_limit():
    # a sleep uses no CPU: this process kills it
    assert run("print('zzz', flush=True)\nimport time\ntime.sleep(60)", wall_seconds=1) == (
        "zzz\ntime limit of 1 s exceeded (wall clock)"
    )


def test_allocating_2_gib_hits_the_memory_limit():
    assert run("x = bytearray(2 * 2**30)") == "memory limit of 256 MiB exceeded (MemoryError)"
    assert run("x = [0] * (2**31 // 8)") == "memory limit of 256 MiB exceeded (MemoryError)"


@pytest.mark.parametrize(
    "code, refused",
    [
        ("import os\nos.fork()", "os.fork"),
        ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
        ("import os\nos.system('true')", "os.system"),
        ("import multiprocessing\nmultiprocessing.Process(target=print).start()", "os.fork"),
    ],
    ids=["os.fork", "subprocess", "os.system", "multiprocessing"],
)
def test_forking_is_refused(code, refused):
    assert run(code) == f"PermissionError: forking is not allowed ({refused})"


def test_exec_sockets_and_ctypes_are_refused():
    assert run("import os\nos.execv('/bin/true', ['true'])") == (
        "PermissionError: running other programs is not allowed (os.exec)"
    )
    assert run("import socket\nsocket.create_connection(('127.0.0.1', 9))") == (
        "PermissionError: network access is not allowed (socket.__new__)"
    )
    assert run("import ctypes\nctypes.CDLL(None).fork()") == "PermissionError: ctypes is not allowed (ctypes.dlopen)"


def test_the_kernel_stops_what_the_audit_hook_does_not_see():
    # starting a thread raises no audit event in Python 3.11; RLIMIT_NPROC = 0 refuses it in the kernel, which
    # is also what stops a fork that gets past the hook. As root that limit only binds because the code runs
    # as another user.
    assert run("import threading\nthreading.Thread(target=print).start()") == "RuntimeError: can't start new thread"


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="_posixsubprocess.fork_exec's arguments as of 3.11")
def test_a_fork_past_the_audit_hook_is_stopped_by_the_kernel():
    # subprocess's own C function forks without an audit event; RLIMIT_NPROC refuses the fork (EAGAIN)
    code = (
        "import _posixsubprocess, os\nr, w = os.pipe()\nexe = [b'/bin/true']\n"
        "_posixsubprocess.fork_exec(exe, exe, True, (w,), None, None, -1, -1, -1, -1, -1, -1, r, w, True, False,"
        " -1, None, None, None, -1, None, False)\nprint('forked')"
    )
    assert run(code) == "BlockingIOError: [Errno 11] Resource temporarily unavailable"


def test_the_environment_is_empty(monkeypatch):
    monkeypatch.setenv("PYTHON_EXEC_TEST_SECRET", "hunter2")
    output = run("import os\nprint(sorted(os.environ))")
    assert "PYTHON_EXEC_TEST_SECRET" not in output and "PATH" not in output and "HOME" not in output
    # what is there: our one-thread setting for OpenBLAS, the working directory as TMPDIR, and the locale
    # Python itself sets (PEP 538)
    assert set(eval(output)) <= {"OMP_NUM_THREADS", "TMPDIR", "LC_CTYPE"}


def test_writing_a_huge_file_hits_the_file_size_limit():
    assert run("open('big', 'wb').write(bytes(2 * 2**20))") == (
        "file size limit of 1 MiB exceeded (OSError: [Errno 27] File too large)"
    )


def test_output_flooding_is_truncated():
    output = run("while True: print('spam')")
    assert output == "spam\n" * 200 + "output truncated after 1000 bytes"
    output = run("import sys\nprint('x' * 10**6, file=sys.stderr)")  # stderr counts too
    assert output == "output truncated after 1000 bytes"


def test_the_working_directory_is_fresh_and_removed():
    output = run("import os, tempfile\nprint(os.getcwd())\nprint(os.listdir())\nprint(tempfile.mkstemp()[1])")
    cwd, listing, temp_file = output.splitlines()
    assert listing == "[]" and not os.path.exists(cwd)
    assert os.path.dirname(temp_file) == cwd  # tempfile writes there too, not into /tmp
    # also when the code made a directory it cannot be listed in, and a link out of it
    code = "import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.chmod('a', 0)\nos.symlink('/', 'root')"
    cwd = run(code + "\nprint(os.getcwd())").strip()
    assert os.path.basename(cwd).startswith("python_exec_")
    assert not os.path.exists(cwd) and os.path.isdir("/")


@pytest.mark.parametrize("code", ["", "import time\ntime.sleep(60)"], ids=["exits", "killed"])
def test_no_process_is_left_behind(code):
    output = run("import os\nprint(os.getpid(), flush=True)\n" + code, wall_seconds=1)
    pid = int(output.split()[0])
    assert not os.path.exists(f"/proc/{pid}")  # not even a zombie: we reaped it


@pytest.mark.skipif(os.geteuid() != 0, reason="as root only")
def test_as_root_the_code_runs_as_nobody():
    output = run("import os\nprint(os.getuid(), os.getgid(), os.getgroups())\nopen('/etc/hosts', 'a')")
    assert output == "65534 65534 []\nPermissionError: [Errno 13] Permission denied: '/etc/hosts'"


def test_its_json_schema():
    from transformers.utils import get_json_schema

    schema = get_json_schema(python_exec.python)
    assert schema["type"] == "function" and schema["function"]["name"] == "python"
    parameters = schema["function"]["parameters"]
    assert parameters["required"] == ["code"] and parameters["properties"]["code"]["type"] == "string"
    assert "print()" in schema["function"]["description"]
    import tools  # --tools examples/tools/python_exec.py offers the model this one function, not the helpers

    assert sorted(tools.load_tools(python_exec.__file__)) == ["python"]
