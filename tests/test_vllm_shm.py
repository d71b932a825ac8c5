"""vllm_engine.py: a tensor-parallel engine's shared memory on CPU. vLLM would give every run on a machine the
same /dev/shm names; ours carry the launcher's pid (tp_shm_name), are unlinked once the engine has started, and a
dead run's are removed before the next engine starts. So a TP run killed with -9 resumes, leaving /dev/shm as
the kill left it, and a second TP run starts beside another. The runs that show it, a TP run killed with -9 beside
an uninterrupted one and resumed to exactly it: tests/test_checkpoint.py."""

import os
import subprocess

from vllm_engine import remove_dead_shm


def dead_pid():
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_dead_runs_segments_are_removed_and_a_live_runs_kept(tmp_path):
    """Named after a launcher that is gone, or after ours (a reused pid: our engine has not started): removed.
    After a live process, and names that are not ours (vLLM's own, anything else): kept."""
    dead, live, ours = dead_pid(), os.getpid(), os.getppid()
    names = {
        f"grpo{dead}-tp:0-[0-1]-cpushm_0": True,
        f"grpo{dead}-tp:0-[0-1]-cpushm_1": True,
        f"grpo{ours}-tp:0-[2-3]-cpushm_0": True,
        f"grpo{live}-tp:0-[0-1]-cpushm_0": False,
        "-tp:0-[0-1]-cpushm_0": False,
        f"grpo{dead}-notes.txt": False,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"")
    removed = remove_dead_shm(str(tmp_path))
    assert sorted(removed) == sorted(str(tmp_path / name) for name, gone in names.items() if gone)
    assert sorted(os.listdir(tmp_path)) == sorted(name for name, gone in names.items() if not gone)
