"""Per-token log-probabilities and entropies of the sampled tokens: first as their formula, from the logits
(logprobs_from_logits, entropy_from_logits), then in two forms that give the same numbers without ever holding
a batch's [B, T, V] logits in fp32: chunk by chunk from the logits (_ChunkedTokenLogProb), and the fused head
(head_logprobs_entropy), straight from the final hidden states and the LM head's weight, a block of tokens x
vocabulary entries at a time, what the trainer runs for a real vocabulary (policy.fusable_head).

Shapes: B sequences, T response tokens, V vocabulary entries, H hidden size. Log-probabilities and
entropies are in nats, fp32. Each faster form is checked against log_softmax of the full logits, value and
gradient (tests/test_logprobs.py).
"""

import math
import sys

import torch


def logprobs_from_logits(logits, labels, temperature=1.0, chunk=1024):
    """Log-probability of each chosen token: log softmax(logits / temperature)[labels].

    logits [B, T, V] (any float dtype, may be a non-contiguous slice), labels [B, T] int64
    -> [B, T] nats, fp32 (fp64 for fp64 logits); labels [B, T, L] -> [B, T, L].
    Computed in at least fp32, `chunk` positions at a time, so memory beyond the logits is
    O(chunk * V), with or without autograd; positions that fit in one chunk (the demo's micro-batch)
    take the formula as written. Pass the sampling temperature so these log-probs
    match the ones the rollout engine sampled with.
    """
    if logits.shape[:-1].numel() > chunk:  # the same numbers, a chunk at a time (_ChunkedTokenLogProb)
        return _ChunkedTokenLogProb.apply(logits, labels, float(temperature), int(chunk))
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # one chunk: as written
    lse = torch.logsumexp(z, -1, keepdim=True)  # [B, T, 1]: log softmax(z)[y] = z[y] - logsumexp(z)
    return z.gather(-1, labels) - lse if labels.dim() == 3 else (z.gather(-1, labels[..., None]) - lse).squeeze(-1)


def entropy_from_logits(logits, chunk=1024, temperature=1.0):
    """Entropy of the next-token distribution softmax(logits / temperature) at every position, in nats.

    H = logsumexp(z) - sum_j softmax(z)_j * z_j,   z = logits / temperature [B, T, V] -> [B, T] fp32.
    Computed in fp32 `chunk` positions at a time; under torch.no_grad() (how the trainer logs it)
    that bounds the extra memory to O(chunk * V).
    """
    entropy = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)  # [B, T]
    for b, t in _chunks(entropy.shape, chunk):
        z = logits[b, t].float() / temperature  # [rows, c, V]
        entropy[b, t] = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    return entropy


# ----------------------------------------------------------------------------------------------
# The same numbers, a chunk of positions at a time (for a vocabulary too small for the fused head)


def _chunks(shape, chunk):
    """(rows, positions) slices covering a [B, T] grid, about `chunk` positions at a time: whole
    rows together when sequences are short, pieces of one row when they are long."""
    B, T = shape
    if T <= chunk:
        step = max(1, chunk // max(T, 1))
        for b in range(0, B, step):
            yield slice(b, b + step), slice(None)
    else:
        for b in range(B):
            for s in range(0, T, chunk):
                yield slice(b, b + 1), slice(s, s + chunk)


class _ChunkedTokenLogProb(torch.autograd.Function):
    """log softmax(z / temp)[label], computed a chunk of positions at a time.

    The plain `log_softmax(logits.float(), -1).gather(...)` keeps a full fp32 [B, T, V] copy alive
    for the backward pass: for a 150k vocabulary that is far larger than the model's activations.
    Here forward keeps only the per-position logsumexp [B, T], and backward recomputes softmax
    chunk by chunk from the logits tensor the model already holds. We loop over sequences and
    position chunks rather than flattening, because the trainer passes a non-contiguous slice
    (the response positions) and flattening it would copy it whole.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk):
        dtype = torch.promote_types(logits.dtype, torch.float32)  # at least fp32
        logp = torch.empty(labels.shape, dtype=dtype, device=logits.device)  # [B, T] (or [B, T, L])
        lse = torch.empty(labels.shape[:2], dtype=dtype, device=logits.device)
        for b, t in _chunks(labels.shape[:2], chunk):
            z = logits[b, t].to(dtype) / temperature  # [rows, c, V], freed after each chunk
            lse[b, t] = torch.logsumexp(z, dim=-1)
            if labels.dim() == 2:
                logp[b, t] = z.gather(-1, labels[b, t, None]).squeeze(-1) - lse[b, t]
            else:  # several ids per position (forward_kl_topk's): [rows, c, L]
                logp[b, t] = z.gather(-1, labels[b, t]) - lse[b, t, None]
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        # d logp / d z_j = (1[j == label] - softmax(z / temp)_j) / temp
        logits, labels, lse = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        g_out = grad_logp.to(lse.dtype)
        if labels.dim() == 3:  # several ids per position: [B, T, L]
            g_sum = g_out.sum(-1)
        else:
            g_out, labels, g_sum = g_out[..., None], labels[..., None], g_out
        for b, t in _chunks(labels.shape[:2], ctx.chunk):
            probs = torch.exp(logits[b, t].to(lse.dtype) / ctx.temperature - lse[b, t, None])  # [rows, c, V]
            g = probs.mul_(-g_sum[b, t, None])
            g.scatter_add_(-1, labels[b, t], g_out[b, t])
            grad[b, t] = g.div_(ctx.temperature)
        return grad, None, None, None


# ----------------------------------------------------------------------------------------------
# The fused head: log-probs and entropies from the hidden states, a block at a time


def head_logprobs_entropy(hidden, weight, labels, temperature=1.0, rows=None, cols=None, entropy=True, extra_ids=None):
    """Log-probs of `labels` and entropies under softmax(hidden @ weight^T / temperature), computed
    with the LM head a block of `rows` tokens x `cols` vocabulary entries at a time
    (_HeadLogProbEntropy): hidden [B, T, H], weight [V, H], labels [B, T] -> (logp [B, T],
    entropy [B, T], or None with entropy=False) in fp32 nats. Blocks default to head_blocks' choice
    for the device. extra_ids [B, T, K] (a teacher's top-k ids): logp is [B, T, 1 + K], the labels' then
    those ids' log-probs, each read inside the blocks, with their gradient."""
    B, T = labels.shape
    default_rows, default_cols = head_blocks(B * T, weight.shape[0], hidden.device, hidden.dtype)
    rows, cols = rows or default_rows, cols or default_cols
    extra = None if extra_ids is None else extra_ids.reshape(B * T, -1)
    logp, ent, at_ids, _, _ = _HeadLogProbEntropy.apply(
        hidden.reshape(B * T, -1), weight, labels.reshape(-1), float(temperature), int(rows), int(cols), entropy, extra
    )
    logp = logp.view(B, T) if extra is None else torch.cat([logp[:, None], at_ids], 1).view(B, T, -1)
    return logp, None if ent is None else ent.view(B, T)


@torch.no_grad()
def head_topk_logprobs(hidden, weight, labels, k, temperature=1.0, rows=None, cols=None):
    """The log-probs of `labels` and of the k most likely tokens, from the LM head a block at a time as
    head_logprobs_entropy (each block's top k merged into a running top k: never a [B, T, V] tensor): hidden
    [B, T, H], weight [V, H], labels [B, T] -> (logp [B, T], top-k log-probs [B, T, k] descending, their ids
    [B, T, k]), fp32 nats. A teacher's pass for forward_kl_topk (distill.py); no gradient."""
    B, T = labels.shape
    default_rows, default_cols = head_blocks(B * T, weight.shape[0], hidden.device, hidden.dtype)
    h, flat = hidden.reshape(B * T, -1), labels.reshape(-1)
    how = (float(temperature), int(rows or default_rows), int(cols or default_cols), False, None, int(k))
    logp, _, _, top_logp, top_ids = _HeadLogProbEntropy.apply(h, weight, flat, *how)
    return logp.view(B, T), top_logp.view(B, T, k), top_ids.view(B, T, k)


def head_blocks(n, V, device, dtype=torch.float32):
    """(rows, cols) of the fused head's blocks for n tokens and a V-entry vocabulary on `device`. CPU:
    512 x 512, 1 MiB of fp32 that stays in a core's cache (measured best there, BENCHMARKS.md); 2048 x 2048
    where the passes are compiled (compiled_passes: bf16 with native bf16), whose larger matmuls run faster. GPUs:
    all n tokens (up to 16,384) by as many vocabulary entries as make 2^26 logits (256 MiB of fp32;
    4,096 entries for 16k tokens), a multiple of 256: few large kernels, and one block of tokens, so the
    backward writes each vocabulary slice's weight gradient once (benchmarks/gpu_update.py measures
    these against the older 2^24 / V tokens by the whole vocabulary)."""
    if device.type == "cpu":
        return (2048, 2048) if compiled_passes(device, dtype) else (512, 512)
    rows = max(1, min(n, 2**14))
    return rows, min(V, max(256, 2**26 // rows // 256 * 256))


class _HeadLogProbEntropy(torch.autograd.Function):
    """The chosen tokens' log-probs and the entropies, straight from the final hidden states and
    the LM head's weight, one block of `rows` tokens x `cols` vocabulary entries at a time: the
    logits z = h W^T / temp exist for one block at a time, in the forward and again (recomputed) in
    the backward, never for the whole batch. With a 151,936-row vocabulary the logits of a batch
    outweigh the model's activations.

        logp = z[label] - logsumexp(z)            H = logsumexp(z) - sum_j p_j z_j,   p = softmax(z)
        d logp / d z = onehot(label) - p         dH / d z = -p * (log p + H)

    The blocks' shape is chosen by device (head_blocks). On CPU a block is 1 MiB of fp32 (512 x 512,
    a core's L2 cache here): it stays in cache between the matmul that writes it and the passes of the
    softmax that read it. On GPUs a block is every token of the micro-batch (up to 16k) by a slice of
    the vocabulary: few large kernels, and in the backward each slice's weight gradient is written once
    for all tokens (a vocabulary-major backward), added in place into the fp32 accumulator, and each
    block's elementwise passes run as one compiled kernel each way (block_passes).

    The forward keeps, per token and vocabulary block b, the block's max m_b and, shifted by it,
    s_b = sum_j exp(z_j - m_b) and t_b = sum_j exp(z_j - m_b)(z_j - m_b), and combines them with
    M = max_b m_b, w_b = exp(m_b - M): S = sum_b w_b s_b, T = sum_b w_b (t_b + (m_b - M) s_b), so
    logsumexp(z) = M + log S and H = log S - T / S (no cancellation: every term is shifted).

    hidden [N, H], weight [V, H], labels [N] -> (logp [N], entropy [N] or None without with_entropy,
    extra [N, K], top log-probs [N, topk], top ids [N, topk]), fp32 (the matmuls in the inputs' dtype, the
    softmax in fp32). The entropy's backward runs only if the loss uses it. forward_kl_topk's two sides, read
    in the same blocks (_ids_in_block): extra_ids [N, K] gives their log-probs (extra, with their gradient:
    each adds its onehot inside its block), topk > 0 the k most likely tokens' (a running top k over the
    blocks, no gradient); None where not asked for.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, rows, cols, with_entropy, extra_ids=None, topk=0):
        ctx.set_materialize_grads(False)  # an unused output (the logged entropy) gets None, not zeros
        n, V = labels.shape[0], weight.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
        extra = None if extra_ids is None else torch.empty(extra_ids.shape, device=hidden.device)  # [n, K] z at ids
        best = (torch.full((n, topk), -math.inf, device=hidden.device), labels.new_zeros(n, topk)) if topk else None
        passes = block_passes(hidden.device, hidden.dtype)
        z, e = _block_buffers(hidden, rows, cols, V, 2) if passes is None else (None, None)
        vocab_blocks = list(_spans(V, cols))
        for r in _spans(n, rows):
            m, s, t = (torch.empty(len(vocab_blocks), r.stop - r.start, device=hidden.device) for _ in range(3))
            for b, v in enumerate(vocab_blocks):
                if passes is not None:  # compiled (GPUs, bf16 CPUs): the max and both sums in one kernel
                    zb = hidden[r] @ weight[v].T
                    m[b], s[b], t[b] = passes[0](zb, temperature)
                    if extra is not None or best is not None:
                        _ids_in_block(zb.float() / temperature, v, r, extra_ids, extra, best)
                    continue
                zb = _logits_block(hidden[r], weight[v], z, temperature)  # [r, k]
                if extra is not None or best is not None:  # before the passes below overwrite the logits
                    _ids_in_block(zb, v, r, extra_ids, extra, best)
                torch.amax(zb, -1, out=m[b])
                d = torch.sub(zb, m[b, :, None], out=_block(e, zb.shape))  # z - m_b
                p = torch.exp(d, out=zb)  # the logits are not needed again
                torch.sum(p, -1, out=s[b])
                if with_entropy:
                    torch.sum(p.mul_(d), -1, out=t[b])
            top = m.amax(0)
            w = torch.exp(m - top)
            total = (s * w).sum(0)
            lse[r] = top + total.log()
            if with_entropy:
                entropy[r] = total.log() - ((t + (m - top) * s) * w).sum(0) / total
        logp = _label_logits(hidden, weight, labels) / temperature - lse
        ctx.save_for_backward(hidden, weight, labels, lse, entropy, extra_ids)
        ctx.temperature, ctx.rows, ctx.cols = temperature, rows, cols
        extra = None if extra is None else extra - lse[:, None]  # log-probs at the extra ids [n, K]
        if best is None:
            return logp, entropy, extra, None, None
        ctx.mark_non_differentiable(best[1])
        return logp, entropy, extra, best[0] - lse[:, None], best[1]

    @staticmethod
    def backward(ctx, g_logp, g_entropy, g_extra, _g_top, _g_ids):
        # d loss / d z = g_logp (onehot - p) - g_entropy p (z - lse + H) = p (a z + c) + g_logp onehot,
        # per token a = -g_entropy and c = g_entropy (lse - H) - g_logp. The onehot term comes last. Extra ids
        # add -sum_k g_extra,k to c and their onehots inside each block.
        hidden, weight, labels, lse, entropy, extra_ids = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[:2]  # a frozen head (LoRA) needs no weight gradient
        n, V = labels.shape[0], weight.shape[0]
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        zero = torch.zeros(n, device=hidden.device)
        g_logp = zero if g_logp is None else g_logp.float()
        a = None if g_entropy is None else -g_entropy.float()
        c = -g_logp if g_entropy is None else g_entropy.float() * (lse - entropy) - g_logp
        if g_extra is not None:
            c = c - g_extra.float().sum(-1)
        passes = block_passes(hidden.device, hidden.dtype)
        z, e = _block_buffers(hidden, ctx.rows, ctx.cols, V, 2) if passes is None else (None, None)
        for r in _spans(n, ctx.rows):  # on GPUs one token block: each vocabulary slice's grad_w is written once
            for v in _spans(V, ctx.cols):
                if passes is not None:  # compiled: p (a z + c) in one kernel, in the matmul's dtype
                    g = passes[1](hidden[r] @ weight[v].T, ctx.temperature, lse[r], None if a is None else a[r], c[r])
                else:
                    zb = _logits_block(hidden[r], weight[v], z, ctx.temperature)  # [r, k]
                    g = torch.sub(zb, lse[r, None], out=_block(e, zb.shape)).exp_()  # p
                    if a is None:
                        g.mul_(c[r, None])
                    else:
                        g.mul_(zb.mul_(a[r, None]).add_(c[r, None]))
                if g_extra is not None:  # the extra ids' onehots that fall in this block
                    local, inside = _local_ids(extra_ids[r], v)
                    g.scatter_add_(1, local, torch.where(inside, g_extra[r].float(), 0.0).to(g.dtype))
                g = g if g.dtype == weight.dtype else g.to(weight.dtype)  # the matmuls in the inputs' dtype
                if want_h:
                    _add_product(grad_h[r], g, weight[v])  # [r, k] @ [k, H]
                if want_w:
                    _add_product(grad_w[v], g.T, hidden[r])  # [k, r] @ [r, H]
        if want_h:  # the onehot term, then d z / d h = W / temp
            grad_h.add_(g_logp[:, None] * weight[labels].float()).div_(ctx.temperature)
        if want_w:  # the onehot term, then d z / d W = h / temp
            grad_w.index_add_(0, labels, g_logp[:, None] * hidden.float()).div_(ctx.temperature)
        grad_h = None if grad_h is None else grad_h.to(hidden.dtype)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None, None


def _local_ids(ids, v):
    """ids [r, K] -> (their columns in the vocabulary block v, clamped into it [r, K]; whether each is in it)."""
    local = ids - v.start
    inside = (local >= 0) & (local < v.stop - v.start)
    return local.clamp(0, v.stop - v.start - 1), inside


def _ids_in_block(zb, v, r, extra_ids, extra, best):
    """One block's logits / temperature [r, k] (fp32), vocabulary entries v, tokens r: the logits at the extra ids
    that fall in it go into extra[r] ([r, K]); with best = (values [n, topk], ids [n, topk]), the top-k so far
    (this block's top-k merged with the earlier blocks') into best[...][r]. Never more than [r, k + topk]."""
    if extra is not None:
        local, inside = _local_ids(extra_ids[r], v)
        extra[r] = torch.where(inside, zb.gather(1, local), extra[r])
    if best is not None:
        k = best[0].shape[1]
        values, ids = zb.topk(min(k, zb.shape[1]), 1)
        values, ids = torch.cat([best[0][r], values], 1), torch.cat([best[1][r], ids + v.start], 1)
        keep = values.topk(k, 1).indices
        best[0][r], best[1][r] = values.gather(1, keep), ids.gather(1, keep)


def _spans(n, size):
    """slice(0, size), slice(size, 2 size), ... covering range(n)."""
    return (slice(s, min(s + size, n)) for s in range(0, n, size))


def _block_buffers(hidden, rows, cols, V, count):
    """`count` flat fp32 buffers of one [rows, cols] block, reused by every block of the loop. On
    CPU a fresh tensor above 32 MiB comes from the kernel (glibc mmaps it) and is zeroed page by
    page each time: with 64 MiB blocks of whole vocabulary rows that was 45% of the fused head's time
    (BENCHMARKS.md). GPU blocks are that large; the buffers are reused there too."""
    size = min(rows, hidden.shape[0]) * min(cols, V)
    return [torch.empty(size, dtype=torch.float32, device=hidden.device) for _ in range(count)]


def _block(buffer, shape):
    """A contiguous [r, k] view of the first r x k entries of a flat buffer."""
    return buffer[: shape[0] * shape[1]].view(shape)


def _logits_block(hidden, weight, buffer, temperature):
    """hidden [r, H] x weight [k, H] -> the fp32 logits / temperature [r, k], in `buffer`. The
    matmul runs in the inputs' dtype and the division in fp32, as vLLM's sampler does it: in bf16 the
    logits are rounded to bf16 once, then scaled (scaling h first would round twice)."""
    z = _block(buffer, (hidden.shape[0], weight.shape[0]))
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        torch.mm(hidden, weight.T, out=z)
    else:
        z.copy_(hidden @ weight.T)
    return z if temperature == 1.0 else z.div_(temperature)


def _label_logits(hidden, weight, labels):
    """z[label] = h . W[label] for each token, as a batched matmul in the inputs' dtype: rounded as
    the head's matmul rounds its logits. [N, H], [V, H], [N] -> [N] fp32."""
    return torch.bmm(hidden[:, None, :], weight[labels][:, :, None]).view(-1).float()


def _add_product(out, a, b):
    """out += a @ b, with out fp32 and a, b in the inputs' dtype: in place when all three are fp32,
    and on CUDA for bf16 too (the matmul accumulates in fp32 and adds into out, no temporary); elsewhere
    the bf16 product is added (a temporary of out's shape: small with CPU blocks)."""
    if out.dtype == a.dtype == b.dtype:
        out.addmm_(a, b)
    elif out.is_cuda:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out += (a @ b).float()


def block_stats(z, temperature):
    """One block's logits [r, k] (in the matmul's dtype) -> per token, in fp32: the max m, sum_j exp(z_j - m)
    and sum_j exp(z_j - m)(z_j - m), of z / temperature: the forward's passes over a block."""
    z = z.float() / temperature
    m = z.amax(-1)
    d = z - m[:, None]
    p = d.exp()
    return m, p.sum(-1), (p * d).sum(-1)


def block_grad(z, temperature, lse, a, c):
    """d loss / d z on one block [r, k] but the onehot term, p (a z + c) (p c when a is None: no entropy
    gradient), with p = exp(z / temperature - lse), in z's dtype: the backward's passes over a block."""
    dtype, z = z.dtype, z.float() / temperature
    p = (z - lse[:, None]).exp()
    g = p * c[:, None] if a is None else p * (z * a[:, None] + c[:, None])
    return g.to(dtype)  # the cast in the same kernel


def compiled_passes(device, dtype):
    """Whether the head's block passes run compiled (block_passes): on CUDA, and in bf16 on a CPU with native bf16
    matmuls (avx512_bf16 or AMX), where the fp32 passes, not the matmuls, were what bf16 left as slow as fp32. In
    fp32 on a CPU the in-place loop over cache-sized blocks measured as fast (BENCHMARKS.md)."""
    if device.type == "cuda":
        return True
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return device.type == "cpu" and dtype == torch.bfloat16 and native


def block_passes(device, dtype):
    """The functions that make one block's elementwise passes where compiled_passes: block_stats and block_grad
    compiled by torch.compile (a block's 5 to 7 passes over its fp32 logits become one kernel each way: the head
    2.9x faster on an H200, 1.9x in bf16 on a 2-core EPYC, BENCHMARKS.md), else None: the in-place loop of
    passes over blocks that stay in cache. Where compiling fails (no working Triton or C++ compiler), the same
    functions uncompiled. On a CPU with dynamic shapes: one graph for every block size, compiled in seconds."""
    if not compiled_passes(device, dtype):
        return None
    if not _PASSES:
        options = {} if device.type == "cuda" else dict(dynamic=True)
        _PASSES.extend(compiled_or_not(f, **options) for f in (block_stats, block_grad))
    return _PASSES


_PASSES = []  # block_passes' functions, made on first use


def compiled_or_not(fn, name=None, failed=None, **options):
    """fn compiled (torch.compile(fn, **options)); if its first compile fails, fn itself from then on, said
    once on stderr, naming `name` (fn's own by default). `failed`, a list several functions share, makes one
    failure theirs too: policy.compile_blocks' modules say it once, and do not each try again."""
    compiled, tried, failed = torch.compile(fn, **options), [], [] if failed is None else failed

    def call(*args, **kwargs):
        if failed:
            return fn(*args, **kwargs)
        if tried:
            return compiled(*args, **kwargs)
        try:
            out = compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001  (any compiler failure: the eager function is the same math)
            print(f"torch.compile of {name or fn.__name__} failed ({type(e).__name__}: {e}); "
                  "running it uncompiled, slower", file=sys.stderr)  # fmt: skip
            failed.append(e)
            return fn(*args, **kwargs)
        tried.append(True)
        return out

    return call
