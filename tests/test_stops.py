"""How a run ends when something goes wrong outside the math: a polite kill (SIGTERM, as Slurm and
Kubernetes send), a rank that stops answering, a diverging policy, a kill during the final export,
a bad flag under torchrun. Each runs the real train_grpo.py under torchrun with the tiny model.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = "--prompt-batch-size 8 --mini-batch-size 8 --group-size 4 --val-max-prompts 16".split()
COMPARED = "critic/score/mean actor/pg_loss actor/grad_norm actor/entropy response_length/mean actor/lr".split()


def command(out_dir, *flags, ranks=1):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return [*launcher, "train_grpo.py", "--out-dir", str(out_dir), *flags]


def run(out_dir, *flags, ranks=1, timeout=600):
    return subprocess.run(
        command(out_dir, *flags, ranks=ranks), cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def steps_logged(out_dir):
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line)["step"] for line in open(path) if line.endswith("\n")]


def start_and_wait_for_step(out_dir, step, *flags, ranks=1):
    """Start a run in the background; return it once `step` is in its metrics.jsonl."""
    proc = subprocess.Popen(
        command(out_dir, *flags, ranks=ranks), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 400
    while step not in steps_logged(out_dir):
        assert proc.poll() is None, f"the run ended early:\n{proc.communicate()[1][-3000:]}"
        assert time.time() < deadline, "the run did not reach step {step}"
        time.sleep(0.2)
    return proc


def rows(out_dir):
    return {r["step"]: r for r in map(json.loads, open(os.path.join(out_dir, "metrics.jsonl")))}


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_rerun_continues_exactly(tmp_path):
    """SIGTERM to torchrun (which passes it to both ranks) mid-run: the ranks finish or abandon the
    step, save it, write the report, and exit 143 with a message; the same command then continues to
    exactly the run that was never interrupted. --save-freq 50: without the handler the 2 or more
    steps done would be lost. 30 steps of 0.2 s: a SIGTERM sent after step 2 cannot land on the last one."""
    flags = [*SMALL, "--max-steps", "30", "--test-freq", "-1", "--save-freq", "50", "--rollout", "vllm"]
    proc = start_and_wait_for_step(tmp_path / "stopped", 2, *flags, ranks=2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    # the ranks exit 143; torchrun, signalled itself, exits 1 with torch's traceback (docs/checkpoints.md)
    assert proc.returncode == 1 and "SignalException" in err, err[-3000:]
    done = max(steps_logged(tmp_path / "stopped"))
    assert 2 <= done < 30
    assert f"stopped by SIGTERM after step {done} of 30" in out + err
    assert "rerun the same command to continue" in out + err
    assert (tmp_path / "stopped" / f"global_step_{done}").is_dir()
    assert (tmp_path / "stopped" / "report" / "report.md").is_file()
    assert not (tmp_path / "stopped" / "final_model").exists()  # the run has not finished

    resumed = run(tmp_path / "stopped", *flags, ranks=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {tmp_path / 'stopped' / f'global_step_{done}'}" in resumed.stdout
    whole = run(tmp_path / "whole", *flags, ranks=2)
    assert whole.returncode == 0, whole.stderr[-3000:]
    a, b = rows(tmp_path / "stopped"), rows(tmp_path / "whole")
    assert sorted(a) == sorted(b) == list(range(1, 31))
    for step in range(1, 31):
        for key in COMPARED:
            assert a[step][key] == b[step][key], f"step {step}: {key} {a[step][key]} != {b[step][key]}"


@pytest.mark.slow
@pytest.mark.parametrize("to, stream", [("torchrun", False), ("the rollout rank", False), ("the rollout rank", True)])
def test_sigterm_with_a_rollout_rank_stops_both_sides_and_the_rerun_finishes(tmp_path, to, stream):
    """--rollout-ranks 1 --max-staleness 1: the trainer saves the step it finished with the rollout already
    made for the next one, tells the rollout rank to stop, and both exit; the same command finishes.
    SIGTERM to torchrun reaches both ranks; to the rollout rank alone (its node preempted), it passes the
    request on with its next rollout (stream: its next groups). 40 steps of about 0.1 s: a SIGTERM after
    step 2 cannot land on the last one."""
    import psutil

    flags = [*SMALL, "--max-steps", "40", "--test-freq", "-1", "--save-freq", "50", "--rollout", "hf"]
    flags += ["--rollout-ranks", "1", "--max-staleness", "1"]
    flags += ["--stream-rollouts", "--rollout", "vllm"] if stream else []
    proc = start_and_wait_for_step(tmp_path, 2, *flags, ranks=2)
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "train_grpo.py" in " ".join(p.cmdline())]
    rollout_rank = [p for p in ranks if p.environ().get("RANK") == "1"]
    (proc if to == "torchrun" else rollout_rank[0]).send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    done = max(steps_logged(tmp_path))
    assert proc.returncode != 0 and f"stopped by SIGTERM after step {done} of 40" in out + err, err[-3000:]
    assert "rollout rank 0: SIGTERM: stopping at the next step boundary" in out + err
    state = json.load(open(tmp_path / f"global_step_{done}" / "trainer_state.json"))
    assert list(state["rollouts_ahead"]) == [str(done + 1)]
    resumed = run(tmp_path, *flags, ranks=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert steps_logged(tmp_path) == list(range(1, 41))


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_within_the_collective_timeout(tmp_path):
    """A rank frozen by SIGSTOP (a hung node, a debugger): the other one waited silently for gloo's
    30 minutes. With --collective-timeout 15 it gives up after 15 s and says what happened."""
    import psutil

    flags = [*SMALL, "--max-steps", "50", "--test-freq", "-1", "--save-freq", "1", "--rollout", "hf"]
    proc = start_and_wait_for_step(tmp_path / "run", 2, *flags, "--collective-timeout", "15", ranks=2)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
    assert len(workers) == 1
    workers[0].send_signal(signal.SIGSTOP)
    stopped = time.time()
    try:
        out, err = proc.communicate(timeout=150)  # 15 s, then torchrun's own grace to kill the frozen rank
    finally:
        if workers[0].is_running():
            workers[0].kill()
    assert proc.returncode != 0
    assert "another rank stopped answering" in err and "--collective-timeout" in err, err[-3000:]
    assert time.time() - stopped < 120
    assert max(steps_logged(tmp_path / "run")) < 50


@pytest.mark.slow
def test_a_diverging_run_skips_updates_saves_only_the_weights_before_it_and_stops(tmp_path):
    """--lr 1e30 with verl's weight decay: AdamW's first step would multiply every weight by 1 - lr x wd =
    -1e28. That is finite, so this run used to take it (and skip the next ones, which would overflow) and
    keep a dead model: entropy ln 20 and gradient norm 0, even after a resume with a small lr. Now such
    updates are skipped, three skipped steps in a row stop the run with a message that names the
    checkpoint to resume from, every checkpoint holds the initial weights, and the resume it advises trains."""
    flags = [*SMALL, "--lr", "1e30", "--weight-decay", "0.01", "--max-steps", "8", "--test-freq", "-1"]
    proc = run(tmp_path / "run", *flags, "--save-freq", "1", "--rollout", "hf")
    assert proc.returncode != 0
    assert "every update was skipped" in proc.stderr and "Lower --lr" in proc.stderr, proc.stderr[-3000:]
    assert "could change weights by up to" in proc.stdout
    assert not (tmp_path / "run" / "final_model").exists()
    logged = rows(tmp_path / "run")
    last = max(logged)
    assert last < 8 and [logged[s].get("actor/skipped_updates") for s in range(last - 2, last + 1)] == [1, 1, 1]
    from safetensors.torch import load_file

    import export

    saved = sorted(int(p.name.split("_")[-1]) for p in (tmp_path / "run").glob("global_step_*"))
    assert saved == list(range(1, last))  # the step that stopped the run is logged, not saved
    assert f"it resumes from {tmp_path / 'run' / f'global_step_{saved[-1]}'}." in proc.stderr, proc.stderr[-3000:]
    initial = load_file(tmp_path / "run" / "tiny_model" / "model.safetensors")
    for step in saved:
        export.export(str(tmp_path / "run" / f"global_step_{step}"), str(tmp_path / f"exported{step}"))
        weights = load_file(tmp_path / f"exported{step}" / "model.safetensors")
        for name, w in weights.items():  # not one update was taken
            torch.testing.assert_close(w.float(), initial[name].float(), rtol=0, atol=0, msg=f"{step} {name}")
    flags = [*SMALL, "--lr", "5e-4", "--weight-decay", "0.01", "--max-steps", last + 2, "--test-freq", "-1"]
    proc = run(tmp_path / "run", *map(str, flags), "--allow-changed", "lr", "--save-freq", "1", "--rollout", "hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = rows(tmp_path / "run")
    for s in (last, last + 1, last + 2):  # it learns again: the dead model had gradient norm 0, entropy ln 20
        assert 0 < logged[s]["actor/grad_norm"] < 100 and not logged[s].get("actor/skipped_updates"), logged[s]
        assert abs(logged[s]["actor/entropy"] - math.log(20)) > 1e-3, logged[s]


@pytest.mark.slow
def test_a_sigterm_during_the_last_steps_save_still_finishes_the_run(tmp_path):
    """SIGTERM to torchrun while the last step's checkpoint is written (GRPO_CRASH_AT=save:2:SIGTERM, which
    sends it and waits for it to arrive): no step is left to stop before, so the run finishes as it would
    have: the final model and the report are written, and the next start says the run has finished."""
    flags = [*SMALL, "--max-steps", "2", "--test-freq", "-1", "--save-freq", "1", "--rollout", "hf"]
    env = dict(os.environ, GRPO_CRASH_AT="save:2:SIGTERM")
    proc = subprocess.run(command(tmp_path, *flags), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "SignalException" in proc.stderr  # torchrun, signalled itself
    assert "rank 0: SIGTERM" in proc.stdout + proc.stderr and "stopped by SIGTERM" not in proc.stdout + proc.stderr
    assert steps_logged(tmp_path) == [1, 2] and (tmp_path / "global_step_2").is_dir()
    assert (tmp_path / "final_model" / "model.safetensors").is_file() and (tmp_path / "report" / "report.md").is_file()
    again = run(tmp_path, *flags)
    assert again.returncode != 0 and "this run has finished (step 2, of 2)" in again.stderr, again.stderr[-2000:]


@pytest.mark.slow
def test_a_finished_run_without_its_final_model_gets_it_on_the_next_start(tmp_path):
    """A kill during the final export left a finished run without final_model. The next start says so
    and exports it from the last checkpoint, before any engine loads; the start after that refuses,
    also before the engine loads."""
    flags = [*SMALL, "--max-steps", "2", "--test-freq", "-1", "--save-freq", "1", "--rollout", "hf"]
    first = run(tmp_path / "run", *flags)
    assert first.returncode == 0, first.stderr[-3000:]
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "run" / "final_model" / "model.safetensors")
    os.rename(tmp_path / "run" / "final_model", tmp_path / "first_final_model")

    again = run(tmp_path / "run", *flags)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        "this run finished (step 2, of 2), but" in again.stdout
        and "final_model is missing; exporting it from" in again.stdout
    )
    assert "rollout engine" not in again.stdout
    exported = load_file(tmp_path / "run" / "final_model" / "model.safetensors")
    assert saved.keys() == exported.keys() and all(torch.equal(saved[k], exported[k]) for k in saved)

    third = run(tmp_path / "run", *flags)
    assert third.returncode != 0 and "this run has finished (step 2, of 2)" in third.stderr
    assert "rollout engine" not in third.stdout


def test_a_flag_error_under_torchrun_is_its_summarys_root_cause(tmp_path):
    """torchrun follows a failed worker with its own traceback and a table; the table's last line,
    where people look, now holds our message instead of "To enable traceback see ..."."""
    proc = run(tmp_path / "run", "--lr", "-1")
    assert proc.returncode != 0
    assert "error: --lr must be >= 0, got -1.0" in proc.stderr
    tail = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("=")][-1]
    assert tail.strip() == "traceback : train_grpo.py: error: --lr must be >= 0, got -1.0", proc.stderr[-2000:]


def test_a_lora_adapter_on_a_tied_head_is_refused_before_anything_loads(tmp_path):
    proc = run(tmp_path / "run", "--lora-rank", "4", "--lora-target-modules", "lm_head", "--max-steps", "1")
    assert proc.returncode != 0
    assert "--lora-target-modules lm_head: this model ties its LM head to the input embeddings" in proc.stderr
    assert "rollout engine" not in proc.stdout
