"""How a [B, T] matrix of per-token loss terms becomes one number: verl's four --loss-agg modes, and
the weights that make micro-batches (and ranks) add up to the whole batch's loss exactly.

Shapes: B sequences, T response tokens; `mask` is 1 on response tokens that count, 0 on padding.
"""

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


SEQ_MEAN_AGG = "seq-mean-token-mean"


def loss_agg_for(mode, agg):
    """The aggregation --loss-mode `mode` uses: gspo, sapo and geo_mean are means over sequences
    whatever --loss-agg says (SEQ_MEAN_AGG); the others use `agg`. The trainer weights micro-batches
    by it (agg_denominator) and aggregates the KL and entropy terms with it too."""
    return SEQ_MEAN_AGG if mode in ("gspo", "sapo", "geo_mean") else agg
