"""logprobs.py: the log-probs and entropies of the sampled tokens, from logits and from the head's
hidden states, against log_softmax of the full logits (value and gradient), and the memory they keep."""

import math

import pytest
import torch

import logprobs
from logprobs import entropy_from_logits, head_logprobs_entropy, head_topk_logprobs, logprobs_from_logits


def naive_logprobs(logits, labels, temperature=1.0):
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, labels[..., None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 3, 10, 1024])  # 10: two whole rows per chunk
def test_logprobs_match_log_softmax(temperature, chunk):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g) * 3
    labels = torch.randint(0, 11, (2, 5), generator=g)
    out = logprobs_from_logits(logits, labels, temperature, chunk)
    assert out.shape == (2, 5) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_logprobs(logits, labels, temperature), atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [2, 4, 6])  # 6: all 6 positions in one chunk, the formula as written
def test_logprobs_gradient_is_exact(chunk):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 7, (2, 3), generator=g)
    # gradcheck compares our hand-written backward (chunk < 6) against finite differences
    assert torch.autograd.gradcheck(lambda z: logprobs_from_logits(z, labels, 0.8, chunk=chunk).double(), (logits,))
    weights = torch.randn(2, 3, generator=g, dtype=torch.float64)
    (logprobs_from_logits(logits, labels, 0.8, chunk) * weights).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    (naive_logprobs(logits, labels, 0.8) * weights).sum().backward()
    torch.testing.assert_close(ours, logits.grad, atol=1e-6, rtol=1e-6)


def test_logprobs_bf16_logits_are_computed_in_fp32():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(4, 6, 50, generator=g) * 4).bfloat16()
    labels = torch.randint(0, 50, (4, 6), generator=g)
    ref = naive_logprobs(logits.float(), labels)  # the bf16 values, softmax taken in fp64
    torch.testing.assert_close(logprobs_from_logits(logits, labels).double(), ref, atol=1e-5, rtol=0)


def saved_bytes(fn, inputs):
    """Bytes autograd keeps alive for backward in tensors other than `inputs` itself."""
    total = []

    def pack(t):
        shares_input = t.untyped_storage().data_ptr() == inputs.untyped_storage().data_ptr()
        total.append(0 if shares_input else t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(total)


def test_logprobs_keep_no_full_fp32_copy_for_backward():
    n, vocab = 64, 4096
    logits = torch.randn(1, n, vocab).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (1, n))
    full_fp32 = n * vocab * 4
    naive = saved_bytes(lambda: torch.log_softmax(logits.float() / 0.7, -1).gather(-1, labels[..., None]), logits)
    ours = saved_bytes(lambda: logprobs_from_logits(logits, labels, 0.7, chunk=8), logits)
    assert naive >= full_fp32  # the measurement would catch a naive implementation
    assert ours < full_fp32 / 100


def test_logprobs_of_a_response_slice_need_no_copy_of_it():
    # the trainer takes the response positions, logits[:, P-1:-1], a non-contiguous view
    full = torch.randn(3, 40, 2048).requires_grad_()
    labels = torch.randint(0, 2048, (3, 30))
    view = full[:, 9:39]
    ours = saved_bytes(lambda: logprobs_from_logits(view, labels, chunk=8), full)
    assert ours < view.numel() * 4 / 100
    torch.testing.assert_close(
        logprobs_from_logits(view, labels).double(), naive_logprobs(view.detach(), labels), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    "temperature, rows, cols, dtype",
    [
        (1.0, 7, 700, torch.float64),
        (1.0, 7, 700, torch.float32),
        (0.7, 37, 3000, torch.float64),
        (1.3, 10_000, 512, torch.float32),
        (1.0, 1000, 1, torch.float64),
    ],
)
def test_head_logprobs_and_entropy_equal_the_logits_path_in_value_and_gradient(temperature, rows, cols, dtype):
    """From hidden states and the head's weight, a block of tokens x vocabulary entries at a time
    (uneven last blocks, whole vocabulary rows, one entry per block; fp32 runs the in-place
    matmuls), against log_softmax and the entropy of the full logits in fp64: every output and both
    gradients (logp and entropy both in the loss), to 1e-5."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 50, 32, dtype=torch.float64)
    weight = torch.randn(3000, 32, dtype=torch.float64) * 0.3
    labels = torch.randint(0, 3000, (3, 50))
    g_logp, g_ent = torch.randn(3, 50, dtype=torch.float64), torch.randn(3, 50, dtype=torch.float64)
    h, w = hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
    logp, ent = head_logprobs_entropy(h, w, labels, temperature, rows, cols)
    ((logp * g_logp.to(dtype)).sum() + (ent * g_ent.to(dtype)).sum()).backward()
    hidden.requires_grad_(), weight.requires_grad_()
    z = hidden @ weight.T / temperature  # [3, 50, V]
    ent_ref = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    logp_ref = naive_logprobs(hidden @ weight.T, labels, temperature)
    ((logp_ref * g_logp).sum() + (ent_ref * g_ent).sum()).backward()
    torch.testing.assert_close(logp.double(), logp_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ent_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(h.grad.double(), hidden.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(w.grad.double(), weight.grad, atol=1e-5, rtol=0)


def test_head_logprobs_in_bf16_round_as_the_heads_matmul_and_sum_in_fp32():
    """bf16 hidden states and weight (the policy's dtype on GPUs; run here on CPU): the logits come
    from bf16 matmuls, the softmax and its sums in fp32. Against the fp64 softmax of the same bf16
    logits: log-probs and entropies to 1e-5 (a softmax in bf16 is 4e-2 off here), and gradients in
    bf16 within 2% of the fp64 ones."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 40, 32).bfloat16(), (torch.randn(5000, 32) * 0.3).bfloat16()
    labels = torch.randint(0, 5000, (2, 40))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = head_logprobs_entropy(h, w, labels, rows=16, cols=1000)
    assert logp.dtype == ent.dtype == torch.float32
    (logp.sum() + 0.1 * ent.sum()).backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    z = (hidden @ weight.T).double()  # the bf16 logits, then fp64
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    zd = hd @ wd.T
    logp_ref = torch.log_softmax(z, -1).gather(-1, labels[..., None])[..., 0]
    ent_ref = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    torch.testing.assert_close(logp.double(), logp_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ent_ref, atol=1e-5, rtol=0)
    ref_logp = torch.log_softmax(zd, -1).gather(-1, labels[..., None])[..., 0]
    ref_ent = torch.logsumexp(zd, -1) - (torch.softmax(zd, -1) * zd).sum(-1)
    (ref_logp.sum() + 0.1 * ref_ent.sum()).backward()
    for got, want in ((h.grad, hd.grad), (w.grad, wd.grad)):
        assert (got.double() - want).abs().max() < 0.02 * want.abs().max()


def test_head_logprobs_without_entropy_give_the_same_log_probs_and_gradients():
    """entropy=False (the old and reference log-probs) skips the entropy's pass: no entropy, and the
    same log-probs and gradients as with the entropy computed and left out of the loss."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 30, 16), torch.randn(900, 16) * 0.3
    labels = torch.randint(0, 900, (2, 30))
    out = {}
    for entropy in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent = head_logprobs_entropy(h, w, labels, 0.9, rows=7, cols=100, entropy=entropy)
        assert (ent is None) == (not entropy)
        logp.sum().backward()
        out[entropy] = logp, h.grad, w.grad
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_head_logprobs_keep_no_logits_and_skip_a_frozen_heads_gradient():
    hidden = torch.randn(1, 64, 16, requires_grad=True)
    weight = torch.randn(20_000, 16)  # frozen, as under LoRA
    labels = torch.randint(0, 20_000, (1, 64))
    saved = saved_bytes(lambda: head_logprobs_entropy(hidden, weight, labels, rows=8), hidden)
    assert saved < weight.numel() * 4 + 64 * 4 * 10  # the weight itself and a few numbers per token: no [64, V] logits
    logp, ent = head_logprobs_entropy(hidden, weight, labels, rows=8)
    logp.sum().backward()  # the entropy unused: only logged
    assert hidden.grad is not None and weight.grad is None


@pytest.mark.parametrize("temperature, rows, cols", [(1.0, 7, 700), (0.7, 37, 64), (1.3, 10_000, 3000), (1.0, 5, 1)])
@pytest.mark.parametrize("passes", ["in place", "block functions"])
def test_head_logprobs_at_a_teachers_top_k_ids_equal_the_logits_path_in_value_and_gradient(
    temperature, rows, cols, passes, monkeypatch
):
    """forward_kl_topk's student side: with extra_ids [B, T, K] the head gives [B, T, 1 + K] log-probs, the labels'
    then those ids', each read inside the blocks (ids in every block, whole rows, one entry per block), against
    log_softmax of the full logits in fp64: values and both gradients to 1e-5, the labels' column unchanged. Both
    ways through a block: the CPU's in-place passes, and the block functions GPUs and bf16 CPUs compile (here
    uncompiled)."""
    if passes == "block functions":
        monkeypatch.setattr(logprobs, "block_passes", lambda device, dtype: [logprobs.block_stats, logprobs.block_grad])
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 20, 32, dtype=torch.float64), torch.randn(3000, 32, dtype=torch.float64) * 0.3
    labels, ids = torch.randint(0, 3000, (3, 20)), torch.randint(0, 3000, (3, 20, 8))
    ids[0, 0] = torch.arange(2992, 3000)  # the last block's last entries
    g = torch.randn(3, 20, 9, dtype=torch.float64)
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    logp, ent = head_logprobs_entropy(h, w, labels, temperature, rows, cols, extra_ids=ids)
    assert logp.shape == (3, 20, 9)
    ((logp * g.float()).sum() + ent.sum()).backward()
    hidden.requires_grad_(), weight.requires_grad_()
    z = hidden @ weight.T / temperature
    ref = torch.log_softmax(z, -1).gather(-1, torch.cat([labels[..., None], ids], -1))
    ((ref * g).sum() + (torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)).sum()).backward()
    torch.testing.assert_close(logp.double(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(h.grad.double(), hidden.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(w.grad.double(), weight.grad, atol=1e-5, rtol=0)
    plain, _ = head_logprobs_entropy(h.detach(), w.detach(), labels, temperature, rows, cols)
    assert torch.equal(plain, logp[..., 0].detach())


@pytest.mark.parametrize("rows, cols, k", [(7, 700, 32), (37, 20, 32), (10_000, 3000, 5), (4, 1, 3)])
@pytest.mark.parametrize("passes", ["in place", "block functions"])
def test_head_top_k_log_probs_equal_the_full_softmaxs_top_k(rows, cols, k, passes, monkeypatch):
    """forward_kl_topk's teacher side: each block's top k merged into a running top k (blocks narrower than k
    included) gives the full log_softmax's k largest log-probs, in order, at the same ids, and the labels'."""
    if passes == "block functions":
        monkeypatch.setattr(logprobs, "block_passes", lambda device, dtype: [logprobs.block_stats, logprobs.block_grad])
    torch.manual_seed(1)
    hidden, weight = torch.randn(2, 25, 16), torch.randn(3000, 16)
    labels = torch.randint(0, 3000, (2, 25))
    logp, top_logp, top_ids = head_topk_logprobs(hidden, weight, labels, k, 0.8, rows, cols)
    full = torch.log_softmax(hidden.double() @ weight.double().T / 0.8, -1)
    want = full.topk(k, -1)
    torch.testing.assert_close(logp.double(), full.gather(-1, labels[..., None])[..., 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(top_logp.double(), want.values, atol=1e-5, rtol=0)
    assert torch.equal(top_ids, want.indices)


def test_logprobs_from_logits_at_several_ids_per_position():
    """The logits path (a head that is not a plain linear layer) at [B, T, L] ids: values and gradient."""
    torch.manual_seed(2)
    logits, ids = torch.randn(3, 9, 50, requires_grad=True), torch.randint(0, 50, (3, 9, 4))
    g = torch.randn(3, 9, 4)
    for chunk in (4, 1024):
        logp = logprobs_from_logits(logits, ids, 0.9, chunk=chunk)
        (grad,) = torch.autograd.grad((logp * g).sum(), logits)
        ref = torch.log_softmax(logits / 0.9, -1).gather(-1, ids)
        (ref_grad,) = torch.autograd.grad((ref * g).sum(), logits)
        torch.testing.assert_close(logp, ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)


def test_entropy():
    vocab = 13
    uniform = torch.zeros(2, 3, vocab)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(vocab)))
    peaked = torch.zeros(1, 1, vocab)
    peaked[..., 4] = 100.0
    assert entropy_from_logits(peaked).item() < 1e-6
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, vocab, generator=g)
    p = torch.softmax(logits.double(), -1)
    torch.testing.assert_close(entropy_from_logits(logits, chunk=5).double(), -(p * p.log()).sum(-1), atol=1e-5, rtol=0)
