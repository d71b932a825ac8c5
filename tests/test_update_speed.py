"""The update's GPU choices, checked on the CPU: the fused head's GPU blocks give the same numbers as the
full logits, the overflow check is the same bound with one device sync (and with it skips an update far
larger than the weights, never at a usual lr), FSDP2 on one rank keeps the gathered weights from forward
to backward but never a stale copy, and the allocator switch."""

import os
import socket
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]

import gpu_update  # noqa: E402

import adamw  # noqa: E402
import distributed  # noqa: E402
import logprobs  # noqa: E402
import policy  # noqa: E402
from logprobs import head_blocks, head_logprobs_entropy  # noqa: E402

CUDA = torch.device("cuda")  # only a name here: head_blocks picks the blocks for it; nothing runs on it


@pytest.mark.parametrize("n, V", [(16384, 151936), (300, 151936), (20000, 49152), (1, 10), (5000, 100)])
def test_gpu_blocks_hold_every_token_and_a_vocabulary_slice_within_the_budget(n, V):
    rows, cols = head_blocks(n, V, CUDA)
    assert rows == min(n, 2**14) and 1 <= cols <= V
    assert rows * cols <= 2**26 or cols == 256  # 256 MiB of fp32 logits per block
    assert cols == V or cols % 256 == 0
    assert head_blocks(n, V, torch.device("cpu")) == (512, 512)  # the CPU's, measured best there


def traced_passes():
    """block_passes' functions through torch.compile's tracing, whole (fullgraph: no fallback to Python),
    with the eager backend: the graphs a GPU compiles into kernels, run here."""
    return [torch.compile(f, backend="eager", fullgraph=True) for f in (logprobs.block_stats, logprobs.block_grad)]


@pytest.mark.parametrize("passes", ["in place", "block functions", pytest.param("traced", marks=pytest.mark.slow)])
def test_the_head_in_gpu_blocks_equals_the_full_logits_in_value_and_gradient(passes, monkeypatch):
    """The GPU geometry, run here: 17,000 tokens are two token blocks (16,384 and an uneven 616) and a
    4,500-entry vocabulary two slices (4,096 and 404), against log_softmax and the entropy of the full
    fp64 logits: both outputs and both gradients to 1e-5 of their largest entry, or 1e-5 below 1 (the
    softmax runs in fp32 in every geometry; the weight's gradient sums 17,000 tokens). Each block's passes
    as the CPU makes them (in place), and as GPUs do (block_passes: the functions, and traced whole as
    torch.compile sees them)."""
    if passes != "in place":
        functions = [logprobs.block_stats, logprobs.block_grad] if passes == "block functions" else traced_passes()
        monkeypatch.setattr(logprobs, "block_passes", lambda device, dtype: functions)
    torch.manual_seed(0)
    n, V, H = 17000, 4500, 4
    rows, cols = head_blocks(n, V, CUDA)
    assert (rows, cols) == (16384, 4096)
    hidden = torch.randn(1, n, H, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(V, H, dtype=torch.float64) * 0.5).requires_grad_()
    labels = torch.randint(0, V, (1, n))
    g_logp, g_ent = torch.randn(1, n, dtype=torch.float64), torch.randn(1, n, dtype=torch.float64)
    logp, ent = head_logprobs_entropy(hidden, weight, labels, 0.8, rows=rows, cols=cols)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    got = [logp, ent, hidden.grad, weight.grad]
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    z = h @ w.T / 0.8
    logp_ref = torch.log_softmax(z, -1).gather(-1, labels[..., None])[..., 0]
    ent_ref = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    ((logp_ref * g_logp).sum() + (ent_ref * g_ent).sum()).backward()
    for a, b in zip(got, [logp_ref, ent_ref, h.grad, w.grad]):
        tolerance = 1e-5 * max(1.0, b.abs().max().item())
        assert (a.double() - b.detach()).abs().max().item() <= tolerance


def test_gpu_passes_without_the_entropy_give_the_cpu_passes_numbers(monkeypatch):
    """entropy=False (the old and reference log-probs; no entropy gradient, block_grad's p c): the GPU's
    block functions, traced, against the CPU's in-place passes on the same blocks, fp32."""
    torch.manual_seed(0)
    hidden, weight, labels = torch.randn(1, 300, 8), torch.randn(1000, 8) * 0.5, torch.randint(0, 1000, (1, 300))
    out = []
    for functions in (None, traced_passes()):
        monkeypatch.setattr(logprobs, "block_passes", lambda device, dtype, f=functions: f)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent = head_logprobs_entropy(h, w, labels, 0.9, rows=128, cols=256, entropy=False)
        (logp * torch.linspace(-1, 1, 300)).sum().backward()
        assert ent is None
        out.append((logp, h.grad, w.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_bf16_on_a_cpu_compiles_the_passes_in_larger_blocks_with_the_loops_numbers(monkeypatch):
    """bf16 on a CPU with native bf16 matmuls: the block passes compiled by inductor (C++; dynamic shapes, so an
    uneven last block is no new graph) over 2048 x 2048 blocks, against the in-place loop over 512 x 512 blocks
    (what fp32 and other CPUs run): the log-probs, the entropies and both gradients agree to bf16's rounding
    of the gradients' block products (the softmax is fp32 either way). Run here whatever the CPU, by asking for it."""
    cpu = torch.device("cpu")
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert logprobs.compiled_passes(cpu, torch.bfloat16) == native and not logprobs.compiled_passes(cpu, torch.float32)
    assert head_blocks(3000, 151936, cpu, torch.bfloat16) == ((2048, 2048) if native else (512, 512))
    torch.manual_seed(0)
    n, V, H = 2500, 5000, 64  # an uneven token block (452) and vocabulary slice (904)
    hidden, weight = (torch.randn(1, n, H) * 0.5).bfloat16(), (torch.randn(V, H) * 0.2).bfloat16()
    labels, g_ent = torch.randint(0, V, (1, n)), torch.randn(1, n) * 0.1
    out = []
    for compiled, blocks in ((False, (512, 512)), (True, (2048, 2048))):
        monkeypatch.setattr(logprobs, "compiled_passes", lambda device, dtype, c=compiled: c)
        logprobs._PASSES.clear()  # made anew for this setting
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent = head_logprobs_entropy(h, w, labels, 0.9, *blocks)
        (logp.sum() + (ent * g_ent).sum()).backward()
        out.append([logp, ent, h.grad.float(), w.grad.float()])
    logprobs._PASSES.clear()
    # the same bf16 logits and an fp32 softmax: 2e-7 seen; the gradients sum bf16 block products, each rounded
    # to bf16 before it is added, so other blocks round otherwise: 1 bf16 unit of the largest entry seen (3.9e-3)
    for a, b, tolerance in zip(*out, (1e-5, 1e-5, 1e-2, 1e-2)):
        assert (a - b).abs().max().item() <= tolerance * max(1.0, b.abs().max().item())


def test_a_pass_whose_compile_fails_runs_uncompiled_and_says_so(monkeypatch, capsys):
    """A GPU without a working Triton: the first call's compile error is said once, and the block's pass
    runs as the plain function from then on, with its numbers."""

    def broken(*args):
        raise RuntimeError("Cannot find a working triton installation")

    monkeypatch.setattr(torch, "compile", lambda fn: broken)
    stats = logprobs.compiled_or_not(logprobs.block_stats)
    z = torch.randn(5, 7)
    for _ in range(2):
        for a, b in zip(stats(z, 0.7), logprobs.block_stats(z, 0.7)):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    err = capsys.readouterr().err
    assert err.count("torch.compile of block_stats failed") == 1 and "triton" in err


# ----------------------------------------------------------------------------------------------
# The overflow check: the decision of the per-tensor version (kept in benchmarks/gpu_update.py), one
# number to the host


def trained(opt_class, lr, **kw):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s)) for s in ((5, 3), (7,), (0,), (4, 4))]
    opt = opt_class(params, lr=lr, **kw)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    for p in params:
        p.grad = torch.randn_like(p) * 10
    params[1].grad = None  # a parameter without a gradient this step is left out
    return params, opt


def host_copies(monkeypatch, opt):
    """adamw.update_may_overflow(opt), and every copy of a tensor's value to the host it made."""
    calls, steps = [], {id(s["step"]) for s in opt.state.values() if "step" in s}  # foreach AdamW's: host counters

    def counted(name, original):
        def call(self, *a, **k):
            if id(self) not in steps:
                calls.append(name)
            return original(self, *a, **k)

        return call

    for name in ("item", "cpu", "tolist", "__float__", "__bool__"):  # every way a value reaches the host
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    got = adamw.update_may_overflow(opt)
    monkeypatch.undo()
    return got, calls


@pytest.mark.parametrize(
    "opt_class, lr, kw, overflows",
    [
        (torch.optim.AdamW, 1e-3, dict(weight_decay=0.01), False),
        (torch.optim.AdamW, 1e30, dict(weight_decay=0.01), True),  # 1e30 / eps 1e-8 x |m| > float32's max
        (torch.optim.SGD, 1e-2, {}, False),
        (torch.optim.SGD, 1e38, {}, True),
    ],
)
def test_the_overflow_check_is_the_per_tensor_bound_with_one_host_copy(monkeypatch, opt_class, lr, kw, overflows):
    params, opt = trained(opt_class, lr, **kw)
    want = gpu_update.old_update_may_overflow(opt)  # the check as it was: a host copy per tensor
    got, calls = host_copies(monkeypatch, opt)
    assert (got is not None) == want == overflows
    assert got is None or got.startswith("this update could make weights non-finite"), got
    assert calls == ["item"], calls


def test_the_overflow_check_sees_a_nan_and_an_optimizer_with_no_gradients():
    params, opt = trained(torch.optim.AdamW, 1e-3)
    assert adamw.update_may_overflow(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])) is None
    opt.state[params[0]]["exp_avg"][0, 0] = float("nan")
    assert "non-finite" in adamw.update_may_overflow(opt)


def first_step(lr, wd, scale=1.0, opt_class=torch.optim.AdamW, largest_grad=None):
    """An optimizer before its first step, over weights of magnitude up to `scale`, with small gradients
    (about 1e-3) and, if given, one of `largest_grad` (1: the most a gradient clipped to norm 1 can hold)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter((torch.rand(*s) * 2 - 1) * scale) for s in ((64, 32), (32,))]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    if largest_grad is not None:
        params[0].grad[0, 0] = largest_grad
    return params, opt_class(params, lr=lr, weight_decay=wd)


def test_an_update_far_larger_than_the_weights_is_skipped_with_one_host_copy(monkeypatch):
    """--lr 1e30 with weight decay: AdamW's first step would multiply every weight by 1 - lr x wd = -1e28
    and add about lr, all finite in float32, so the overflow bound alone let it through and the run saved a
    dead model. The change is bounded by lr (wd max|w| + 1) at the first step, 1e30 times the weights."""
    params, opt = first_step(1e30, 0.01)
    got, calls = host_copies(monkeypatch, opt)
    assert got is not None and got.startswith("this update could change weights by up to"), got
    assert "1e+30" in got and calls == ["item"], (got, calls)
    before = [p.detach().clone() for p in params]
    opt.step()  # what the check foresaw: finite, and 1e28 times the weights
    assert all(torch.isfinite(p).all() and p.abs().max() > 1e27 * b.abs().max() for p, b in zip(params, before))


@pytest.mark.parametrize("lr", [1e-6, 1e-4, 1e-3])
@pytest.mark.parametrize("wd", [0.0, 0.01, 0.1])
def test_usual_learning_rates_never_trip_the_check(lr, wd):
    """AdamW's first step (|m / sqrt(v)| = 1 exactly), a later one after gradients that grew 1000-fold (the
    moments' ratio near its bound), and SGD, over weights as large as a norm's (1) and as small as a LoRA
    adapter's (0.01, or 0 for its B matrix): each would move a weight by at most 0.73 x the largest
    one (7.3e-3, lr 1e-3 x the bound 7.27, over 0.01), far below MAX_GROWTH."""
    for scale in (1.0, 0.01, 0.0):
        params, opt = first_step(lr, wd, scale, largest_grad=1.0)
        assert adamw.update_may_overflow(opt) is None
        for k in range(100):
            for p in params:
                p.grad = torch.full_like(p, 1e-3 * 1.07**k)
            opt.step()
        assert adamw.update_may_overflow(opt) is None
        sgd = first_step(lr, wd, scale, torch.optim.SGD, largest_grad=1.0)[1]
        assert adamw.update_may_overflow(sgd) is None


def test_adams_step_stays_within_its_bound_whatever_the_gradients():
    """p' = p (1 - lr wd) - lr s with |s| <= adam_step_bound at every step: here for 300 steps of
    gradients whose scale jumps by up to 1e9 or vanishes, and of gradients that grow by b2 / b1 each
    step, the case that reaches the bound (once the bias corrections are near 1: with betas (0.5, 0.9)
    within 300 steps; (0.9, 0.999) would take thousands)."""
    torch.manual_seed(0)
    assert adamw.adam_step_bound((0.9, 0.999)) == pytest.approx(7.27, abs=0.01)
    assert adamw.adam_step_bound((0.9, 0.8)) == adamw.adam_step_bound(None) == float("inf")
    for b1, b2 in ((0.9, 0.999), (0.5, 0.9)):
        lr, wd, bound = 1e-2, 0.1, adamw.adam_step_bound((b1, b2))
        p = torch.nn.Parameter(torch.randn(1000, dtype=torch.float64))
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd, betas=(b1, b2))
        for k in range(300):
            jumping = torch.randn(500, dtype=torch.float64) * 10.0 ** torch.randint(-6, 4, (500,)) * (k % 5 > 0)
            p.grad = torch.cat([jumping, torch.full((500,), (b2 / b1) ** k, dtype=torch.float64)])
            before = p.detach().clone()
            opt.step()
            s = (before * (1 - lr * wd) - p.detach()).abs() / lr  # [1000] |m / (sqrt(v) + eps)|, bias-corrected
            assert s.max() <= bound + 1e-9, (b1, b2, k)
    assert s[500:].min() > 0.99 * bound  # (0.5, 0.9): 1.86, reached by the growing gradients' step


def test_the_stop_after_skipped_updates_names_the_checkpoint_to_resume_from_or_says_it_starts_over():
    """The checkpoint saved (or resumed from) last holds the weights from before the skipped updates."""
    from types import SimpleNamespace

    args = SimpleNamespace(lr=1e30, resume="auto")
    said = adamw.diverged_message(args, 4, 6, "runs/x/global_step_3", None)
    assert said.startswith("steps 4-6: every update was skipped") and "Lower --lr (now 1e+30)" in said
    assert "rerun with --allow-changed lr: it resumes from runs/x/global_step_3." in said
    assert "with no checkpoint saved, that starts the run over" in adamw.diverged_message(args, 1, 3, None, None)
    args.resume = "never"  # a rerun with --resume never would be refused: it must ask for this checkpoint
    said = adamw.diverged_message(args, 4, 6, "runs/x/global_step_3", None)
    assert "rerun with --allow-changed lr --resume runs/x/global_step_3." in said


# ----------------------------------------------------------------------------------------------
# FSDP2 on one rank: gathered from forward to backward, never stale


def one_rank_model(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from models import build_tiny_model
    from tasks.digits import TASK_WORDS

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", TASK_WORDS))
    return policy.shard(model, init_device_mesh("cpu", (1,)), torch.bfloat16)


def test_one_rank_keeps_gathered_weights_to_the_backward_and_never_trains_on_a_stale_copy(tmp_path):
    """With one rank a block's weights stay gathered after its forward (no second gather for the backward
    or the shared prompts' second forward) and are resharded by the backward. A forward without a
    backward (compute_logprobs: old log-probs, the weight-sync probe) reshards them itself: else an
    optimizer step would leave the next forward the gathered copy of the weights before it."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    model = one_rank_model(tmp_path)
    try:
        block = model.model.layers[0]
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 20, (5,), generator=g).tolist() for _ in range(2)]
        responses = [torch.randint(3, 20, (4,), generator=g).tolist() for _ in range(2)]
        batch = policy.make_batch(prompts, responses, pad_id=0)
        view = policy.micro_batch(batch, [0, 1])
        logp, _ = policy.response_logprobs(model, view, torch.device("cpu"), 1.0)
        assert not isinstance(block.self_attn.q_proj.weight, DTensor)  # still gathered, for the backward
        logp.sum().backward()
        assert isinstance(block.self_attn.q_proj.weight, DTensor)  # the backward resharded it
        how = dict(micro=2, max_tokens=0, temperature=1.0, device=torch.device("cpu"))
        before = policy.compute_logprobs(model, batch, **how)
        assert isinstance(block.self_attn.q_proj.weight, DTensor)
        torch.optim.SGD(model.parameters(), lr=1.0).step()  # a large step: the log-probs must move
        after = policy.compute_logprobs(model, batch, **how)
        assert (after - before).abs().max() > 1e-3
        fresh = policy.compute_logprobs(model, batch, **how)  # the same weights, gathered again
        torch.testing.assert_close(after, fresh, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_expandable_segments_switch_on_cuda_only_and_never_over_the_users_setting(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", seen.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    distributed.expandable_segments(True)
    assert seen == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    distributed.expandable_segments(True)
    distributed.expandable_segments(False)
    assert seen == ["expandable_segments:True", "expandable_segments:False"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    distributed.expandable_segments(True)
    assert len(seen) == 2
