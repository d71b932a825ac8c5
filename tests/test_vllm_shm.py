"""vllm_engine.py: a tensor-parallel engine's shared memory on CPU. vLLM would give every run on a machine the
same /dev/shm names; ours carry the launcher's pid (tp_shm_name), are unlinked once the engine has started, and a
dead run's are removed before the next engine starts. So a TP run killed with -9 resumes, leaving /dev/shm as
the kill left it, and a second TP run starts beside another."""

import os
import subprocess
import sys

import pytest

import checkpoint
from vllm_engine import SHM_DIR, remove_dead_shm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = "--rollout vllm --tensor-parallel-size 2 --max-steps 2 --prompt-batch-size 8 --mini-batch-size 8 --group-size 4 --test-freq 2 --val-max-prompts 16 --save-freq 1".split()


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


@pytest.fixture
def launch():
    """Starts train_grpo.py on 2 CPU ranks that run one vLLM engine (TP 2), not waiting for it; a run still going
    when the test ends (it failed) is killed, with its ranks (run_dir.die_with_launcher)."""
    runs = []

    def start(out_dir, crash_at=None):
        env = {k: v for k, v in os.environ.items() if k != "GRPO_CRASH_AT"}
        env.update({"GRPO_CRASH_AT": crash_at} if crash_at else {})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_grpo.py"]
        cmd += ["--out-dir", str(out_dir), *RUN]
        runs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return runs[-1]

    yield start
    for run in runs:
        if run.poll() is None:
            run.kill()
            run.communicate()


def finish(proc):
    """(exit code, stdout, stderr) of a launched run."""
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


@pytest.mark.slow
def test_a_killed_tensor_parallel_run_resumes_and_another_runs_beside_it(tmp_path, launch):
    pytest.importorskip("vllm")
    killed, beside = launch(tmp_path / "killed", crash_at="update:2"), launch(tmp_path / "beside")
    code, out, err = finish(killed)  # both ranks kill -9 themselves in step 2, after step 1's checkpoint
    tracker = tmp_path / "killed" / checkpoint.TRACKER
    assert code != 0 and tracker.exists() and tracker.read_text().strip() == "1", err[-5000:]
    code, out, err = finish(beside)
    assert code == 0, err[-5000:]
    # what a kill while the engine started leaves behind: the dead launcher's segment, which the resume removes
    left = os.path.join(SHM_DIR, f"grpo{killed.pid}-tp:0-[0-1]-cpushm_0")
    open(left, "wb").close()
    resumed = launch(tmp_path / "killed")
    code, out, err = finish(resumed)
    assert code == 0 and "resumed from" in out, err[-5000:]
    assert f"removed {left}: the shared memory of a dead run's vLLM engine" in out
    for run in (killed, beside, resumed):  # the kill -9 left nothing in /dev/shm either
        assert not [name for name in os.listdir(SHM_DIR) if name.startswith(f"grpo{run.pid}-")]
