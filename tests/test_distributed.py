"""distributed.py: metrics reduced over two real gloo processes, including keys one rank lacks; what a stop
signal says."""

import os
import subprocess
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reduce_on(rank, port, results):
    import torch.distributed as dist

    from distributed import reduce_metrics

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    metrics = {
        "critic/score/mean": [0.25, 0.75][rank],
        "critic/score/max": [1.0, 3.0][rank],
        "critic/score/min": [0.0, -1.0][rank],
        "training/rollout_logprob_diff_max": [2e-6, 1e-6][rank],  # verl's name, without the slash: a max too
    }
    if rank == 1:  # a reward that returned an extra key on this rank's samples only
        metrics["reward_extra/acc/mean"] = 0.5
    results[rank] = reduce_metrics(metrics, torch.device("cpu"))
    dist.destroy_process_group()


def test_metrics_are_reduced_over_ranks_even_when_their_keys_differ():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(reduce_on, args=(port, results), nprocs=2, join=True)
    expected = {
        "critic/score/mean": 0.5,
        "critic/score/max": 3.0,
        "critic/score/min": -1.0,
        "training/rollout_logprob_diff_max": 2e-6,
        "reward_extra/acc/mean": 0.5,
    }
    assert results[0] == results[1] == expected  # the same on both ranks; the extra key averaged where it exists


def test_a_stop_signal_says_what_it_does_with_a_step_left_and_after_the_last():
    # a SIGTERM after the last step said "stopping at the next step boundary", of which there was none
    code = "import os, signal, distributed; distributed.catch_stop_signals(); os.kill(os.getpid(), signal.SIGTERM)"
    code += "; print(distributed.stop_signal())"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "RANK": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == [
        "rank 1: SIGTERM: stopping at the next step boundary "
        "(after the last step: the run finishes as usual and writes its final model)",
        "15",  # asked to stop; the loop decides where
    ], out.stderr[-2000:]
