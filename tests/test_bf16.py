"""--dtype bf16: FSDP2 mixed precision (bf16 compute, fp32 master weights, optimizer states and
gradient reduction), the engine, the reference and the exported model in bf16. These run on any
CPU: where bf16 matmuls are not native, torch emulates them (slower, the same numbers)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, check_saved_model, metrics

import policy
from logprobs import head_logprobs_entropy, logprobs_from_logits

# 4 short steps, a checkpoint after every step, the reference model on (--kl-coef > 0)
RUN = "--dtype bf16 --max-steps 4 --prompt-batch-size 8 --mini-batch-size 8 --group-size 4 --test-freq 2 --val-max-prompts 16 --save-freq 1 --kl-coef 0.01".split()
COMPARED = "critic/score/mean actor/pg_loss actor/kl_loss actor/grad_norm actor/entropy response_length/mean".split()


def train(out_dir, *flags, ranks=1, crash_at=None):
    env = {k: v for k, v in os.environ.items() if k != "GRPO_CRASH_AT"}
    if crash_at:
        env["GRPO_CRASH_AT"] = crash_at
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd = [*launcher, "train_grpo.py", "--out-dir", str(out_dir), *RUN, *flags]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    if crash_at:
        assert proc.returncode != 0, "the run was meant to die"
    else:
        assert proc.returncode == 0, f"train_grpo.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def test_dtype_choice_and_why(monkeypatch):
    cpu = torch.device("cpu")
    assert policy.compute_dtype("fp32", cpu)[0] == torch.float32
    assert policy.compute_dtype("bf16", cpu)[0] == torch.bfloat16
    monkeypatch.setattr(policy, "native_bf16", lambda device: True)
    assert policy.compute_dtype("auto", cpu) == (torch.bfloat16, "--dtype auto on a CPU with native bf16 matmuls")
    assert "--dtype auto" in policy.compute_dtype("fp32", cpu)[1]  # the hint where bf16 would be faster
    monkeypatch.setattr(policy, "native_bf16", lambda device: False)
    dtype, why = policy.compute_dtype("auto", cpu)
    assert dtype == torch.float32 and "without native bf16" in why
    assert "emulated" in policy.compute_dtype("bf16", cpu)[1]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_head_in_bf16_rounds_the_logits_once_as_vllm_does(temperature):
    """vLLM's sampler takes the head's bf16 logits to fp32, then divides by the temperature. The fused
    head does the same: it used to scale the bf16 hidden states first, which rounds them again
    (a gap of ~1e-2 nats at temperature 0.7 on these logits). The gradients match the logits path's."""
    torch.manual_seed(0)
    hidden = (torch.randn(2, 5, 64) * 3).bfloat16().requires_grad_()
    weight = (torch.randn(300, 64) / 4).bfloat16().requires_grad_()
    labels = torch.randint(0, 300, (2, 5))
    logp, ent = head_logprobs_entropy(hidden, weight, labels, temperature, rows=4, cols=128)
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logits = (h2 @ w2.T).float()  # bf16 matmul, fp32 after: what vLLM's sampler sees
    ref = logprobs_from_logits(logits, labels, temperature)
    assert (logp - ref).abs().max() < 1e-5
    z = logits / temperature
    ref_ent = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    assert (ent - ref_ent).abs().max() < 1e-4
    (logp.sum() + ent.sum()).backward()
    (ref.sum() + ref_ent.sum()).backward()
    for ours, theirs in ((hidden.grad, h2.grad), (weight.grad, w2.grad)):
        assert ours.dtype == torch.bfloat16
        assert (ours.float() - theirs.float()).abs().max() <= 2e-2 * theirs.float().abs().max()


@pytest.mark.slow
def test_bf16_on_two_ranks_with_the_reference_resumes_exactly_and_exports_bf16(tmp_path):
    """2 ranks, the transformers engine in bf16, the reference model: killed mid-update at step 3 and
    rerun, the run is exactly the uninterrupted one; final_model is bf16 (config.json's dtype) and loads
    in transformers and vLLM alike. The engine-vs-trainer gap stays at bf16's rounding."""
    train(tmp_path / "whole", "--rollout", "hf", ranks=2)
    train(tmp_path / "killed", "--rollout", "hf", ranks=2, crash_at="update:3")
    proc = train(tmp_path / "killed", "--rollout", "hf", ranks=2)
    assert "compute dtype: bf16 (--dtype bf16" in proc.stdout
    a, b = metrics(tmp_path / "whole"), metrics(tmp_path / "killed")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for x, y in zip(a, b):
        for key in COMPARED:
            assert x.get(key) == y.get(key), f"step {x['step']}: {key} {x.get(key)} != {y.get(key)}"
    assert a[4]["actor/kl_loss"] > 0 and all(r["actor/grad_norm"] > 0 for r in a[1:])
    assert max(r["training/rollout_probs_diff_mean"] for r in a[1:]) < 2e-3
    from safetensors.torch import load_file

    final = tmp_path / "whole" / "final_model"
    assert json.load(open(final / "config.json"))["dtype"] == "bfloat16"
    wa, wb = (
        load_file(final / "model.safetensors"),
        load_file(tmp_path / "killed" / "final_model" / "model.safetensors"),
    )
    assert all(t.dtype == torch.bfloat16 for t in wa.values())
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert check_saved_model(final, [f"list 1 2 3 4 5 {d} last" for d in range(4)]) <= 1e-2
    state = json.load(open(tmp_path / "whole" / "global_step_4" / "trainer_state.json"))
    assert state["config"]["dtype"] == "bf16"  # export writes bf16 by default, as final_model
    export = [sys.executable, "export.py", str(tmp_path / "whole" / "global_step_4")]
    subprocess.run([*export, str(tmp_path / "exported")], cwd=REPO, check=True, capture_output=True)
    assert all(torch.equal(t, wa[k]) for k, t in load_file(tmp_path / "exported" / "model.safetensors").items())
    subprocess.run([*export, str(tmp_path / "fp32"), "--dtype", "fp32"], cwd=REPO, check=True, capture_output=True)
    assert all(t.dtype == torch.float32 for t in load_file(tmp_path / "fp32" / "model.safetensors").values())


@pytest.mark.slow
def test_bf16_lora_on_vllm(tmp_path):
    """LoRA in bf16 on one rank, vLLM in bf16: the adapters train (fp32 master copies), the engine
    samples from the merged weights synced to it in bf16 (the gap would grow if they never arrived),
    and the merged final model is bf16."""
    train(tmp_path, "--rollout", "vllm", "--lora-rank", "8", "--lr", "5e-3", "--save-freq", "-1")
    rows = metrics(tmp_path)
    assert all(r["actor/grad_norm"] > 0 for r in rows[1:])
    assert rows[4]["actor/kl_loss"] > 0  # the adapters moved the policy away from its base
    assert max(r["training/rollout_probs_diff_mean"] for r in rows[1:]) < 2e-3
    assert json.load(open(tmp_path / "final_model" / "config.json"))["dtype"] == "bfloat16"


@pytest.mark.slow
def test_dtype_auto_resumes_its_own_run_and_a_changed_dtype_is_refused(tmp_path):
    """--dtype auto is recorded as what it resolved to, before the resume check: rerunning the same
    command continues the run (it was refused as 'bf16' there, 'auto' now). Another compute dtype
    than the run's is refused unless --allow-changed dtype says so."""
    from policy import compute_dtype

    resolved = "bf16" if compute_dtype("auto", torch.device("cpu"))[0] == torch.bfloat16 else "fp32"
    flags = ["--dtype", "auto", "--max-steps", "2", "--prompt-batch-size", "8", "--group-size", "4", "--save-freq", "1"]
    flags += ["--test-freq", "-1", "--no-val-before-train", "--rollout", "hf"]
    train(tmp_path, *flags, crash_at="update:2")
    proc = train(tmp_path, *flags)
    assert f"compute dtype: {resolved} (--dtype auto" in proc.stdout
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]
    other = "fp32" if resolved == "bf16" else "bf16"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_grpo.py"]
    more = [a if a != "2" else "3" for a in flags]  # --max-steps 3: a changed dtype is refused before it runs
    refused = subprocess.run(
        [*launcher, "--out-dir", str(tmp_path), *RUN, *more, "--dtype", other], cwd=REPO, capture_output=True, text=True
    )
    assert refused.returncode != 0 and f"--dtype: '{resolved}' there, '{other}' now" in refused.stderr
