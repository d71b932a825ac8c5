"""one_step.py, the reader's tour of one GRPO step, is the trainer's step: train_grpo.py --rollout hf
--max-steps 1 on one rank (its FSDP2 policy, its loop) and the tour (a plain model, no torchrun) sample the
same tokens, score them the same, compute the same advantages, loss terms and gradient norms, and end with
the same weights, bit for bit. Shared prompts run in both (on by default), so the fast path is checked too."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

# train_grpo.main in this process, its step's rollout, advantages and loss terms recorded as they pass
RECORD_TRAINER = """
import sys, torch
import train_grpo
out, sys.argv = sys.argv[1], ["train_grpo.py"] + sys.argv[2:]
seen, batch_of, update_of = {}, train_grpo.training_batch, train_grpo.update_policy

def training_batch(ro, samples, args, pad_id, device):
    batch, advantages, mask = batch_of(ro, samples, args, pad_id, device)
    seen.update(response_ids=ro.response_ids, scores=ro.scores, advantages=advantages.clone())
    return batch, advantages, mask

def update_policy(*args, **kwargs):
    stats, trainer_logp, skipped = update_of(*args, **kwargs)
    seen.update(stats=stats, skipped=skipped)
    return stats, trainer_logp, skipped

train_grpo.training_batch, train_grpo.update_policy = training_batch, update_policy
train_grpo.main()
torch.save(seen, out)
"""

RECORD_TOUR = """
import sys, torch
import one_step
torch.save(one_step.main(sys.argv[2:]), sys.argv[1])
"""


def run(code, out, *flags):
    done = subprocess.run(
        [sys.executable, "-c", code, str(out), *flags], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return torch.load(out, weights_only=False), done.stdout


@pytest.mark.slow
def test_the_tour_is_the_trainers_step(tmp_path):
    from safetensors.torch import load_file

    import one_step

    trainer, _ = run(
        RECORD_TRAINER, tmp_path / "trainer.pt", *one_step.TOUR_FLAGS,
        *("--out-dir", str(tmp_path / "trainer"), "--max-steps", "1", "--test-freq", "-1", "--save-freq", "-1"),
    )  # fmt: skip
    tour, printed = run(RECORD_TOUR, tmp_path / "tour.pt", "--out-dir", str(tmp_path / "tour"))
    assert trainer["response_ids"] == tour["response_ids"] and trainer["scores"] == tour["scores"]
    assert sum(tour["scores"]) > 0, "no sample was right: nothing to learn, a weak comparison"
    assert torch.equal(trainer["advantages"], tour["advantages"])
    grad_norms = [s.pop("grad_norm") for s in trainer["stats"] if "grad_norm" in s]
    assert trainer["skipped"] == 0 and len(grad_norms) == 2  # --mini-batch-size 32: two optimizer steps
    assert grad_norms == tour["grad_norms"]
    assert trainer["stats"] == tour["stats"]  # every micro-batch's loss terms: pg_loss, kl_loss, entropy, ...
    assert all(s["kl_loss"] > 0 for s in tour["stats"][len(tour["stats"]) // 2 :])  # after the first step
    saved = load_file(os.path.join(tmp_path, "trainer", "final_model", "model.safetensors"))
    assert saved.keys() <= tour["weights"].keys()
    assert all(torch.equal(saved[k], tour["weights"][k]) for k in saved)
    config = json.load(open(os.path.join(tmp_path, "trainer", "config.json")))
    assert config["kl_coef"] == 0.001 and config["mini_batch_size"] == 32 and config["share_prompts"]
    # each block names the file:function whose math it shows
    for where in ("advantage.py:grpo_advantages", "loss.py:clipped_surrogate", "adamw.py:guarded_step"):
        assert f"[{where}" in printed
