"""distributed.py: metrics reduced over two real gloo processes, including keys one rank lacks."""

import os
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
