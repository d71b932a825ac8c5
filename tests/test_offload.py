"""--offload: its flag, and what it moves. FSDP2's CPU offload itself needs a GPU; it ran on an H100
in benchmarks/gpu.py (BENCHMARKS.md, "On a GPU"). Here: the flag is accepted with a GPU and refused
without one, and the optimizer's moments move while its step counts stay."""

import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import config  # noqa: E402
from adamw import move_optimizer_states  # noqa: E402


def test_offload_is_accepted_with_a_gpu_and_refused_without():
    for choice in ("optimizer", "params", "both"):
        args = config.Args(offload=choice)
        assert config.check_args(args, cuda=True) == []
        problems = config.check_args(args, cuda=False)
        assert problems == [
            f"--offload {choice}: it moves GPU memory to the CPU, and this machine has no CUDA GPU (a CPU run "
            "keeps everything in CPU memory already): use --offload none"
        ]
    assert config.check_args(config.Args(offload="none"), cuda=False) == []


def test_move_optimizer_states_moves_the_moments_and_keeps_the_step():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    steps = {id(p): s["step"].clone() for p, s in optimizer.state.items()}
    move_optimizer_states(optimizer, "meta")  # a device other than the CPU, without a GPU
    for p, state in optimizer.state.items():
        assert state["exp_avg"].device.type == state["exp_avg_sq"].device.type == "meta"
        assert state["step"].device.type == "cpu" and torch.equal(state["step"], steps[id(p)])  # AdamW's place
