"""examples/tools/python_exec.py: the `python` tool runs model-written code in a child process and
returns what it printed, or the limit it hit. Each test puts small limits on one call (run() below),
so a runaway program costs a second or two. As root, the code runs as nobody (UNPRIVILEGED_UID).
Its files are confined (a private root) where this machine allows it; the tests of that skip elsewhere."""

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox uses Linux's limits")

PATH = os.path.join(os.path.dirname(__file__), "..", "examples", "tools", "python_exec.py")
spec = importlib.util.spec_from_file_location("python_exec", PATH)
python_exec = importlib.util.module_from_spec(spec)
os.environ["PYTHON_EXEC_UNCONFINED"], unconfined = "1", os.environ.get("PYTHON_EXEC_UNCONFINED")
spec.loader.exec_module(python_exec)  # loaded without its refusal at import (tested below), then restored
os.environ.pop("PYTHON_EXEC_UNCONFINED") if unconfined is None else os.environ.update(PYTHON_EXEC_UNCONFINED=unconfined)
CONFINEMENT_PROBLEM = python_exec._confinement_problem() if sys.platform.startswith("linux") else "not Linux"
needs_confinement = pytest.mark.skipif(CONFINEMENT_PROBLEM is not None, reason=f"{CONFINEMENT_PROBLEM}")


def run(code, **limits):
    """_run_python with small limits; a keyword overrides one of them."""
    limits = {
        "cpu_seconds": 1,
        "wall_seconds": 6,  # well past 1 s of CPU even on a busy 2-core machine
        "memory_bytes": 256 * 2**20,
        "file_bytes": 2**20,
        "disk_bytes": 4 * 2**20,
        "disk_files": 100,
        "output_bytes": 1000,
        "uid": python_exec.UNPRIVILEGED_UID if os.geteuid() == 0 else None,
        "confine": CONFINEMENT_PROBLEM is None,  # where it cannot be, the other limits are tested without
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
    # a sleep uses no CPU: this process kills it. (3 s, not 1: the clock also counts Python's start and the
    # private root's mounts, which took over a second on a 2-core machine running 6 processes)
    assert run("print('zzz', flush=True)\nimport time\ntime.sleep(60)", wall_seconds=3) == (
        "zzz\ntime limit of 3 s exceeded (wall clock)"
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


@needs_confinement
def test_the_code_cannot_read_the_machines_files(tmp_path):
    # not by permissions (as root the old sandbox read a root-only file): the files are not in its root
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    secret.chmod(0o600)
    root_dir = tempfile.mkdtemp(dir="/root") if os.geteuid() == 0 and os.path.isdir("/root") else None
    paths = [str(secret), "/etc/passwd", "/proc/self/environ", "/sys/kernel", "/home", "/dev/shm"]
    if root_dir:
        shutil.copy(secret, f"{root_dir}/secret.txt")
        paths.append(f"{root_dir}/secret.txt")
    code = f"import os\nfor p in {paths!r}:\n    print(os.path.exists(p), end=' ')\nprint(open({paths[-1]!r}).read())"
    try:
        output = run(code)
    finally:
        if root_dir:
            shutil.rmtree(root_dir)
    assert output == "False " * len(paths) + f"\nFileNotFoundError: [Errno 2] No such file or directory: {paths[-1]!r}"


@needs_confinement
def test_files_written_outside_the_working_directory_stay_in_the_sandbox():
    marker = f"python_exec_test_{os.getpid()}_{time.time_ns()}"
    code = (
        f"for d in ['/tmp', '/dev/shm']:\n    try:\n        open(d + '/{marker}', 'w').write('x')\n"
        "        print(d, 'written')\n    except OSError as e:\n        print(d, type(e).__name__)"
    )
    try:
        output = run(code)
        left = [p for p in (f"/tmp/{marker}", f"/dev/shm/{marker}") if os.path.exists(p)]
    finally:
        for path in glob.glob(f"/tmp/{marker}") + glob.glob(f"/dev/shm/{marker}"):
            os.remove(path)
    assert left == []
    assert output == "/tmp written\n/dev/shm FileNotFoundError\n"  # its /tmp is its own; it has no /dev/shm


@needs_confinement
def test_filling_the_disk_stops_at_the_total_limit():
    # RLIMIT_FSIZE is per file: many 1 MiB files once filled the machine's RAM through /dev/shm
    marker = f"python_exec_test_{os.getpid()}_{time.time_ns()}"
    code = (
        f"for i in range(64):\n    open(f'/tmp/{marker}_{{i}}', 'wb').write(bytes(2**20))\n    print(i + 1, flush=True)"
    )
    try:
        output = run(code)
        left = glob.glob(f"/tmp/{marker}*")
    finally:
        for path in glob.glob(f"/tmp/{marker}*"):
            os.remove(path)
    *written, note = output.splitlines()
    assert note == "disk limit of 4 MiB or 100 files exceeded (OSError: [Errno 28] No space left on device)"
    assert 1 <= len(written) <= 4 and left == []
    # so is the number of files, even empty ones
    output = run("import os\nfor i in range(10**6):\n    os.mkdir(str(i))")
    note, made = output.rsplit(" ", 1)  # made: "'77')", the directory it could not make
    assert note == "disk limit of 4 MiB or 100 files exceeded (OSError: [Errno 28] No space left on device:"
    assert 50 <= int(made.strip("')")) < 100  # the sandbox's own directories count
    # and nothing of it is mounted here: the sandbox's mounts live and die in its own mount namespace
    with open("/proc/self/mountinfo") as f:
        assert "python_exec_" not in f.read()


@needs_confinement
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="as root: anyone else runs all above so")
def test_as_an_unprivileged_user_it_confines_through_a_user_namespace(tmp_path):
    # root makes a mount namespace directly, anyone else first a user namespace: as user 1000 in a user
    # namespace of util-linux's unshare, the tool takes that path (root outside still, so no fork tests here)
    code = f"import os\nprint(os.getuid(), os.path.exists({str(tmp_path)!r}))\nopen('/tmp/x', 'wb').write(bytes(5 * 2**20))"
    tool = f"import sys\nsys.path.insert(0, {os.path.dirname(PATH)!r})\nimport python_exec as p\n"
    limits = "p._limits() | {'disk_bytes': 4 * 2**20, 'file_bytes': 8 * 2**20}"
    command = ["unshare", "--user", "--map-user=1000", "--map-group=1000", sys.executable, "-c"]
    result = subprocess.run(
        [*command, f"{tool}print(p._run_python({code!r}, **{limits}))"], capture_output=True, text=True
    )
    disk = "disk limit of 4 MiB or 1000 files exceeded (OSError: [Errno 28] No space left on device)"
    assert (result.stdout, result.stderr) == (f"1000 False\n{disk}\n", "")


def test_without_confinement_the_tool_refuses_unless_told(monkeypatch, tmp_path):
    # a machine without user namespaces, simulated: the tool must not quietly run the code unconfined
    monkeypatch.setattr(python_exec, "_confinement_problem", lambda: "unshare: Operation not permitted (simulated)")
    monkeypatch.delenv("PYTHON_EXEC_UNCONFINED", raising=False)
    with pytest.raises(RuntimeError, match=r"refusing .*\(simulated\)\. .* PYTHON_EXEC_UNCONFINED=1 runs it anyway"):
        python_exec.python("print('ran')")
    # the opt-out runs it, and gives up what the message says: the code reads this user's files
    monkeypatch.setenv("PYTHON_EXEC_UNCONFINED", "1")
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    assert python_exec.python(f"print(open({str(secret)!r}).read())") == "hunter2\n"


def test_without_confinement_loading_it_as_a_tool_stops_the_run_at_its_start(monkeypatch, tmp_path):
    """--tools examples/tools/python_exec.py on such a machine: the load fails with the refusal, rather than
    the run training on a tool whose every call is an error."""
    import tools

    source = open(PATH).read()
    marker = "# Loaded as a tool (--tools)"
    assert source.count(marker) == 1
    simulated = "_confinement_problem = lambda: 'unshare: Operation not permitted (simulated)'\n"
    (tmp_path / "python_exec.py").write_text(source.replace(marker, simulated + marker))
    monkeypatch.delenv("PYTHON_EXEC_UNCONFINED", raising=False)
    with pytest.raises(RuntimeError, match=r"refusing .*\(simulated\)\. .* PYTHON_EXEC_UNCONFINED=1 runs it anyway"):
        tools.load_tools(str(tmp_path / "python_exec.py"))
    monkeypatch.setenv("PYTHON_EXEC_UNCONFINED", "1")
    assert sorted(tools.load_tools(str(tmp_path / "python_exec.py"))) == ["python"]


def test_its_json_schema(monkeypatch):
    from transformers.utils import get_json_schema

    if CONFINEMENT_PROBLEM is not None:  # loading it would refuse (tested above): this test is of its schema
        monkeypatch.setenv("PYTHON_EXEC_UNCONFINED", "1")

    schema = get_json_schema(python_exec.python)
    assert schema["type"] == "function" and schema["function"]["name"] == "python"
    parameters = schema["function"]["parameters"]
    assert parameters["required"] == ["code"] and parameters["properties"]["code"]["type"] == "string"
    assert "print()" in schema["function"]["description"]
    import tools  # --tools examples/tools/python_exec.py offers the model this one function, not the helpers

    assert sorted(tools.load_tools(python_exec.__file__)) == ["python"]
