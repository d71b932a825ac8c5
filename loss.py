"""The GRPO objective: per-token log-probs and entropy, KL estimators, loss aggregation and the
clipped policy-gradient surrogate.

Shapes: B sequences (prompts x samples), T response tokens, V vocabulary entries. `mask` is 1 on
response tokens that count and 0 on padding. Log-probabilities are in nats.

Each function states its formula; the definitions follow verl's `core_algos.py` so that numbers
from the two codebases can be compared directly.
"""

import torch

# ----------------------------------------------------------------------------------------------
# Log-probabilities and entropy from logits


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
        logp = torch.empty(labels.shape, dtype=dtype, device=logits.device)  # [B, T]
        lse = torch.empty_like(logp)
        for b, t in _chunks(labels.shape, chunk):
            z = logits[b, t].to(dtype) / temperature  # [rows, c, V], freed after each chunk
            lse[b, t] = torch.logsumexp(z, dim=-1)
            logp[b, t] = z.gather(-1, labels[b, t, None]).squeeze(-1) - lse[b, t]
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        # d logp / d z_j = (1[j == label] - softmax(z / temp)_j) / temp
        logits, labels, lse = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        g_out = grad_logp.to(lse.dtype)
        for b, t in _chunks(labels.shape, ctx.chunk):
            probs = torch.exp(logits[b, t].to(lse.dtype) / ctx.temperature - lse[b, t, None])  # [rows, c, V]
            g = probs.mul_(-g_out[b, t, None])
            g.scatter_add_(-1, labels[b, t, None], g_out[b, t, None])
            grad[b, t] = g.div_(ctx.temperature)
        return grad, None, None, None


class _HeadLogProbEntropy(torch.autograd.Function):
    """The chosen tokens' log-probs and the entropies, straight from the final hidden states and
    the LM head's weight, one block of `rows` tokens x `cols` vocabulary entries at a time: the
    logits z = h W^T / temp exist for one block at a time, in the forward and again (recomputed) in
    the backward, never for the whole batch. With a 151,936-row vocabulary the logits of a batch
    outweigh the model's activations.

        logp = z[label] - logsumexp(z)            H = logsumexp(z) - sum_j p_j z_j,   p = softmax(z)
        d logp / d z = onehot(label) - p         dH / d z = -p * (log p + H)

    On CPU a block is 1 MiB of fp32 (512 x 512, a core's L2 cache here): it stays in cache between
    the matmul that writes it and the passes of the softmax that read it. A block of whole rows of a
    151,936 vocabulary (64 MiB) goes to memory and back for each pass, and each pass then cost
    about as much as the matmul (BENCHMARKS.md). On GPUs a block is whole rows, few large kernels.

    The forward keeps, per token and vocabulary block b, the block's max m_b and, shifted by it,
    s_b = sum_j exp(z_j - m_b) and t_b = sum_j exp(z_j - m_b)(z_j - m_b), and combines them with
    M = max_b m_b, w_b = exp(m_b - M): S = sum_b w_b s_b, T = sum_b w_b (t_b + (m_b - M) s_b), so
    logsumexp(z) = M + log S and H = log S - T / S (no cancellation: every term is shifted).

    hidden [N, H], weight [V, H], labels [N] -> (logp [N], entropy [N] or None without with_entropy),
    fp32 (the matmuls in the inputs' dtype, the softmax in fp32). The entropy's backward runs only if
    the loss uses it.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, rows, cols, with_entropy):
        ctx.set_materialize_grads(False)  # an unused output (the logged entropy) gets None, not zeros
        n, V = labels.shape[0], weight.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
        z, e = _block_buffers(hidden, rows, cols, V, 2)
        vocab_blocks = list(_spans(V, cols))
        for r in _spans(n, rows):
            m, s, t = (torch.empty(len(vocab_blocks), r.stop - r.start, device=hidden.device) for _ in range(3))
            for b, v in enumerate(vocab_blocks):
                zb = _logits_block(hidden[r], weight[v], z, temperature)  # [r, k]
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
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.temperature, ctx.rows, ctx.cols = temperature, rows, cols
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        # d loss / d z = g_logp (onehot - p) - g_entropy p (z - lse + H) = p (a z + c) + g_logp onehot,
        # per token a = -g_entropy and c = g_entropy (lse - H) - g_logp. The onehot term comes last.
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[:2]  # a frozen head (LoRA) needs no weight gradient
        n, V = labels.shape[0], weight.shape[0]
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        zero = torch.zeros(n, device=hidden.device)
        g_logp = zero if g_logp is None else g_logp.float()
        a = None if g_entropy is None else -g_entropy.float()
        c = -g_logp if g_entropy is None else g_entropy.float() * (lse - entropy) - g_logp
        z, e = _block_buffers(hidden, ctx.rows, ctx.cols, V, 2)
        for r in _spans(n, ctx.rows):
            for v in _spans(V, ctx.cols):
                zb = _logits_block(hidden[r], weight[v], z, ctx.temperature)  # [r, k]
                g = torch.sub(zb, lse[r, None], out=_block(e, zb.shape)).exp_()  # p
                if a is None:
                    g.mul_(c[r, None])
                else:
                    g.mul_(zb.mul_(a[r, None]).add_(c[r, None]))
                if want_h:
                    _add_product(grad_h[r], g, weight[v])  # [r, k] @ [k, H]
                if want_w:
                    _add_product(grad_w[v], g.T, hidden[r])  # [k, r] @ [r, H]
        if want_h:  # the onehot term, then d z / d h = W / temp
            grad_h.add_(g_logp[:, None] * weight[labels].float()).div_(ctx.temperature)
        if want_w:  # the onehot term, then d z / d W = h / temp
            grad_w.index_add_(0, labels, g_logp[:, None] * hidden.float()).div_(ctx.temperature)
        grad_h = None if grad_h is None else grad_h.to(hidden.dtype)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


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
    """out += a @ b: in place when all three are fp32, else the product in b's dtype."""
    if out.dtype == a.dtype == b.dtype:
        out.addmm_(a, b)
    else:
        out += (a.to(b.dtype) @ b).float()


def head_logprobs_entropy(hidden, weight, labels, temperature=1.0, rows=None, cols=None, entropy=True):
    """Log-probs of `labels` and entropies under softmax(hidden @ weight^T / temperature), computed
    with the LM head a block of `rows` tokens x `cols` vocabulary entries at a time
    (_HeadLogProbEntropy): hidden [B, T, H], weight [V, H], labels [B, T] -> (logp [B, T],
    entropy [B, T], or None with entropy=False) in fp32 nats. Blocks default to 512 x 512 on CPU,
    and on GPUs to whole vocabulary rows, about 16M logits per block (110 tokens for a 151,936-row
    vocabulary)."""
    V = weight.shape[0]
    if hidden.device.type == "cpu":
        rows, cols = rows or 512, cols or 512
    else:
        rows, cols = rows or max(1, 2**24 // V), cols or V
    B, T = labels.shape
    logp, ent = _HeadLogProbEntropy.apply(
        hidden.reshape(B * T, -1), weight, labels.reshape(-1), float(temperature), int(rows), int(cols), entropy
    )
    return logp.view(B, T), None if ent is None else ent.view(B, T)


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


def logprobs_from_logits(logits, labels, temperature=1.0, chunk=1024):
    """Log-probability of each chosen token: log softmax(logits / temperature)[labels].

    logits [B, T, V] (any float dtype, may be a non-contiguous slice), labels [B, T] int64
    -> [B, T] nats, fp32 (fp64 for fp64 logits).
    Computed in at least fp32, `chunk` positions at a time, so memory beyond the logits is
    O(chunk * V), with or without autograd. Pass the sampling temperature so these log-probs
    match the ones the rollout engine sampled with.
    """
    return _ChunkedTokenLogProb.apply(logits, labels, float(temperature), int(chunk))


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
# KL estimators

KL_KINDS = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}


def kl_penalty(logp, ref_logp, kind="k3"):
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs, [B, T] -> [B, T].

    With d = logp - ref_logp (tokens sampled from pi):
      k1  ("kl"):          d                                    unbiased, high variance, can be < 0
      abs:                 |d|
      k2  ("mse"):         d^2 / 2
      k3  ("low_var_kl"):  exp(-d) - (-d) - 1 = r - log r - 1,  r = pi_ref / pi
                           unbiased, low variance, always >= 0 (Schulman, "Approximating KL").
                           As in verl, log r is clamped to [-20, 20] and the value to [-10, 10].
    verl's names are accepted as aliases.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {sorted(KL_KINDS)}")
    kind = KL_KINDS[kind]
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    log_r = torch.clamp(-d, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_r) - log_r - 1.0, min=-10.0, max=10.0)


# ----------------------------------------------------------------------------------------------
# Loss aggregation

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_mean(x, mask):
    """sum(x * mask) / sum(mask); 0 when the mask is empty."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def agg_loss(loss_mat, mask, mode="token-mean", norm_len=None):
    """Reduce a per-token loss [B, T] to a scalar, as verl 0.9 does on one rank.

      token-mean:               sum_{i,t} l_it m_it / sum_{i,t} m_it        (DAPO; verl's default)
      seq-mean-token-sum:       mean_i  sum_t l_it m_it
      seq-mean-token-mean:      mean_i (sum_t l_it m_it / sum_t m_it)      (the original GRPO paper)
      seq-mean-token-sum-norm:  mean_i  sum_t l_it m_it / norm_len          (Dr. GRPO)

    mean_i is over the sequences with at least one unmasked token. Dr. GRPO divides each sequence's
    token sum by one constant instead of by its own length, so that a long response's tokens weigh as
    much as a short one's: `norm_len` is verl's loss_scale_factor, and defaults to T (the padded
    width of this batch). The trainer always passes a constant (--loss-scale-factor, by default
    --max-response-length), never the width of a micro-batch's window, which changes from batch to batch.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    seq_sum = (loss_mat * mask).sum(-1)  # [B]
    seq_valid = (mask.sum(-1) > 0).to(loss_mat.dtype)  # [B]
    if mode == "seq-mean-token-sum":
        return masked_mean(seq_sum, seq_valid)
    if mode == "seq-mean-token-mean":
        return masked_mean(seq_sum / mask.sum(-1).clamp(min=1), seq_valid)
    if mode == "seq-mean-token-sum-norm":
        return masked_mean(seq_sum, seq_valid) / (loss_mat.shape[-1] if norm_len is None else norm_len)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {list(AGG_MODES)}")


def agg_denominator(mask, mode):
    """What agg_loss averages this batch over: its unmasked tokens (token-mean) or its sequences
    with at least one unmasked token (every seq-mean-* mode; Dr. GRPO's constant comes on top).

    A batch split into micro-batches (and over ranks) gives exactly agg_loss of the whole batch
    when each piece's loss is weighted by  piece's denominator / whole batch's denominator, and the
    weighted losses are summed.
    """
    if mode == "token-mean":
        return mask.sum().item()
    return (mask.sum(-1) > 0).sum().item()


# ----------------------------------------------------------------------------------------------
# The clipped surrogate

LOSS_MODES = ("vanilla", "gspo")


def policy_loss(
    logp,
    old_logp,
    advantages,
    mask,
    clip_low=0.2,
    clip_high=0.2,
    clip_c=3.0,
    agg="token-mean",
    rollout_is_weights=None,
    norm_len=None,
    mode="vanilla",
):
    """PPO's clipped surrogate with dual clip, the GRPO policy-gradient loss. All inputs [B, T].
    mode="gspo" computes gspo_policy_loss instead (see there; it ignores clip_c, agg and norm_len).

      ratio   = exp(clamp(logp - old_logp, -20, 20))
      l_clip  = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
      l       = min(l_clip, -A * clip_c)   where A < 0   (dual clip: bounds the loss when a token
                l_clip                     where A >= 0   with A < 0 has become far more likely)
      loss    = agg_loss(l * w, mask, agg, norm_len)   w = rollout_is_weights, or 1

    `rollout_is_weights` [B, T] is the truncated importance-sampling correction for the gap
    between the rollout engine and the trainer: w = min(pi_old / pi_engine, cap), no gradient.

    Returns (loss, metrics). Metrics, all masked token means and detached:
      pg_clipfrac        share of tokens where the clipped term is the larger one (it was clipped)
      pg_clipfrac_lower  share of tokens with A < 0 where the dual clip bound applied
      ppo_kl             mean of old_logp - logp (k1 estimate of KL(old || new))
    """
    if mode == "gspo":
        return gspo_policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high, rollout_is_weights)
    if mode != "vanilla":
        raise ValueError(f"unknown policy loss mode {mode!r}; expected one of {list(LOSS_MODES)}")
    if clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1.0 for the dual clip to bound anything, got {clip_c}")
    log_ratio = torch.clamp(logp - old_logp, min=-20.0, max=20.0)  # [B, T]
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_clip = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = torch.minimum(loss_clip, -advantages * clip_c)
    loss_mat = torch.where(advantages < 0, loss_dual, loss_clip)
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach()

    mask_f = mask.to(loss_mat.dtype)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(mask_f.dtype), mask_f),
            "pg_clipfrac_lower": masked_mean(
                ((loss_clip > -advantages * clip_c) & (advantages < 0)).to(mask_f.dtype), mask_f
            ),
            "ppo_kl": masked_mean(-log_ratio, mask_f),
        }
    return agg_loss(loss_mat, mask_f, agg, norm_len), metrics


GSPO_AGG = "seq-mean-token-mean"  # what gspo_policy_loss always aggregates with (weight micro-batches by it)


def gspo_policy_loss(logp, old_logp, advantages, mask, clip_low=3e-4, clip_high=4e-4, rollout_is_weights=None):
    """GSPO (Zheng et al. 2025): the clipped surrogate on a per-sequence ratio, as verl's
    compute_policy_loss_gspo. All inputs [B, T].

      log s_i  = sum_t (logp_it - old_logp_it) m_it / max(sum_t m_it, 1)      length-normalized seq ratio
      log s_it = min(logp_it - sg(logp_it) + sg(log s_i), 10)                  sg = stop-gradient (detach)
      l_it     = max(-A_it * s_it, -A_it * clamp(s_it, 1 - clip_low, 1 + clip_high))
      loss     = agg_loss(l * w, mask, "seq-mean-token-mean")                  w = rollout_is_weights, or 1

    s_it has the value s_i (the same for every token of sequence i), and its gradient is
    s_i * grad(logp_it): the sequence ratio weights each token's policy gradient, and a sequence
    whose clipped term wins (s_i past the clip range on the side A favours) gives no gradient. GSPO's clip range is far narrower than PPO's (the paper uses
    3e-4 / 4e-4): pass it as clip_low / clip_high.

    What we matched in verl: no dual clip (clip_c is not used); log s_it is clamped from above only,
    at 10, and logp - old_logp is not clamped at +-20 as in the vanilla loss; the aggregation is
    always seq-mean-token-mean (GSPO_AGG), whatever the caller's agg; rollout_is_weights multiply the
    per-token loss before aggregation.

    Returns (loss, metrics), with verl's definitions (masked token means, detached):
      pg_clipfrac        share of tokens where the clipped term is the larger one
      pg_clipfrac_lower  0 (there is no dual clip; kept so the logged keys do not change)
      ppo_kl             mean of old_logp - logp, per token, not clamped
    """
    mask_f = mask.to(logp.dtype)
    log_ratio = logp - old_logp  # [B, T]
    seq_log_ratio = (log_ratio * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1)  # [B], log s_i
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]  # [B, T], value log s_i
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))  # [B, T]
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach()

    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(mask_f.dtype), mask_f),
            "pg_clipfrac_lower": torch.zeros((), dtype=mask_f.dtype, device=mask_f.device),
            "ppo_kl": masked_mean(-log_ratio, mask_f),
        }
    return agg_loss(loss_mat, mask_f, GSPO_AGG), metrics


def micro_batch_loss(logp, token_entropy, view, *, agg, args):
    """The loss of one micro-batch: the clipped surrogate (--loss-mode), + kl_coef x the KL to the
    reference, - entropy_coef x the entropy, each aggregated by `agg` (train_grpo's --flags in
    `args`). logp and token_entropy [b, r]: the policy's, for the micro-batch's window of the batch
    (`view`: policy.window), which carries the advantages and the old, reference and engine
    log-probs. Returns (loss, {name: number} of every term for the log, the old log-probs [b, r])."""
    device = logp.device
    m = view["response_mask"].to(device)  # [b, r]
    old = logp.detach() if view.get("old_logp") is None else view["old_logp"].to(device)  # on-policy: ratio 1
    is_weights = None
    if args.tis_cap > 0:  # truncated importance sampling: the engine sampled, the trainer scores
        is_weights = torch.exp(old - view["engine_logp"].to(device)).clamp(max=args.tis_cap) * m
    adv = view["advantages"].to(device)  # [b, r]
    norm_len = args.loss_scale_factor or args.max_response_length  # Dr. GRPO's constant, never the window's width
    pg_loss, pg_metrics = policy_loss(
        logp,
        old,
        adv,
        m,
        clip_low=args.clip_low,
        clip_high=args.clip_high,
        clip_c=args.clip_c,
        agg=agg,
        rollout_is_weights=is_weights,
        norm_len=norm_len,
        mode=args.loss_mode,
    )
    loss, kl_loss = pg_loss, torch.zeros(())
    if view.get("ref_logp") is not None:
        kl_loss = agg_loss(kl_penalty(logp, view["ref_logp"].to(device), args.kl_kind), m, agg, norm_len)
        loss = loss + args.kl_coef * kl_loss
    entropy = agg_loss(token_entropy, m, agg, norm_len)
    if args.entropy_coef > 0:
        loss = loss - args.entropy_coef * entropy
    terms = dict(pg_loss=pg_loss, kl_loss=kl_loss, entropy=entropy, policy_loss=loss, **pg_metrics)
    return loss, {k: v.item() for k, v in terms.items()} | {"tokens": m.sum().item()}, old
