"""On-policy distillation (OPD): the student samples as in GRPO, a frozen teacher scores every sampled token,
and each of the student's tokens gets beta * (teacher log-prob - student log-prob) added to its advantage: the
per-token reverse KL's (negative) estimate, a dense signal beside the reward's one number per answer.

    --teacher DIR --distill-coef 1              OPD beside the reward (GRPO's group advantage + the teacher's term)
    --teacher DIR --no-reward                   pure OPD: the teacher's term alone; rows need no ground truth
    --teacher DIR --teacher-prompt-key KEY      OPSD: the teacher reads another prompt from the row (e.g. with the
                                                worked solution), then the student's response ids exactly

The teacher is loaded like the KL reference (policy.load_frozen, in the run's dtype) and scored with the
reference's machinery (policy.reference_logprobs): the same --model directory is the reference copy (or with
LoRA the base), and `self` is the current policy. Its tokenizer must be the student's (check_teacher, before
anything loads). The teacher is frozen and never checkpointed: a resumed run scores with the same teacher
(docs/distill.md).
"""

import contextlib
import json
import math
import os

import torch
import torch.distributed as dist

import lora
from distributed import all_sum, print0
from logprobs import head_topk_logprobs
from loss import teacher_in_loss
from model_dir import check_model_path, context_length
from policy import (
    fusable_head,
    load_frozen,
    make_batch,
    micro_batch,
    micro_batches,
    reference_logprobs,
    reshard,
    response_logits,
    run_head,
)
from prompt_data import PROMPT_ONLY_SOURCE, VERL_COLUMNS
from reward import BUILTIN_SOURCES, compute_score
from run_log import timed

SELF = "self"  # --teacher self: the current policy, with the teacher's prompt (OPSD without another copy)

# ----------------------------------------------------------------------------------------------
# The math


def teacher_advantages(teacher_logp, student_logp, mask, coef):
    """The teacher's term of each token's advantage, [N, R] -> [N, R] fp32:

        A^T_t = beta * (log pi_T(y_t | x_T, y_<t) - log pi_old(y_t | x, y_<t)) * m_t

    y_t: the sampled token; x: the student's prompt, x_T the teacher's (the same prompt for OPD, the
    privileged one for OPSD); m_t: 1 on the model's own tokens (not the tools', not padding). Its negative,
    log pi_old - log pi_T, is the per-token sample estimate (k1) of the reverse KL(pi_old || pi_T), so
    maximising the surrogate with this advantage pulls the student toward the teacher's modes, as the
    anchors (Thinking Machines' post, verl, prime-rl) do. pi_old: the trainer's log-prob under the weights
    that start this step's update (a constant in the loss), not the engine's: the teacher's log-probs come
    from the same code and dtype, so a teacher equal to the student gives exactly 0, where the engine's
    differ from the trainer's by bf16's rounding (up to 0.6 nats, docs/precision.md); and with
    --max-staleness they are the current policy's, whose KL to the teacher is the one being lowered.
    """
    return coef * (teacher_logp.float() - student_logp.float()) * mask


def add_teacher_term(batch, teacher_logp, student_logp, *, coef, reward, device):
    """batch["advantages"] ([N, R]) <- the reward's advantage (0 with reward=False: --no-reward) + the
    teacher's term (teacher_advantages). Returns the step's distill/* metrics, over every rank's tokens
    the loss trains on: the reverse KL's per-token mean and max, the teacher's mean log-prob, and adv_share,
    mean |teacher term| / (mean |teacher term| + mean |reward term|) (1: all from the teacher)."""
    mask = batch["response_mask"]  # [N, R]
    term = teacher_advantages(teacher_logp, student_logp, mask, coef)  # [N, R]
    reward_part = batch["advantages"] if reward else torch.zeros_like(term)
    batch["advantages"] = reward_part + term
    metrics = teacher_metrics(teacher_logp, student_logp, mask, device)
    teacher_abs, reward_abs = (all_sum(x.abs()[mask.bool()].sum().item(), device) for x in (term, reward_part))
    return metrics | {"distill/adv_share": teacher_abs / max(teacher_abs + reward_abs, 1e-12)}


def teacher_metrics(teacher_logp, student_logp, mask, device):
    """distill/reverse_kl/mean and max (log pi_old - log pi_T per model token, nats) and distill/teacher_logp/mean,
    over every rank's tokens: what every --distill-loss logs, from the step's old log-probs."""
    on = mask.bool()
    kl = (student_logp.float() - teacher_logp.float())[on]  # [tokens] nats
    tokens = max(all_sum(on.sum().item(), device), 1)
    sums = [all_sum(x, device) for x in (kl.sum().item(), teacher_logp.float()[on].sum().item())]
    return {
        "distill/reverse_kl/mean": sums[0] / tokens,
        "distill/reverse_kl/max": all_max(kl.max().item() if kl.numel() else -math.inf, device),
        "distill/teacher_logp/mean": sums[1] / tokens,
    }


def all_max(x, device):
    """The largest of a number over ranks (these metrics join the step's after they were reduced)."""
    t = torch.tensor(float(x), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ----------------------------------------------------------------------------------------------
# One step's teacher pass


def teacher_term(batch, policy, teacher, old, *, samples, args, device, timing):
    """The teacher's pass (timed as teacher) after the old and reference ones (train_grpo.logprob_passes): it
    scores the student's tokens with policy.reference_logprobs (forward_kl_topk: teacher_topk, also its top-k), and
    with the old log-probs `old` its term joins batch["advantages"] (add_teacher_term; the default k1), or the
    batch carries its log-probs for the loss (loss.distill_loss: batch["teacher_logp"], ["teacher_topk_*"]).
    samples: each row's dataset row (OPSD's teacher prompt). Returns the per-token advantages to log and the
    distill/* metrics. A teacher whose log-probs are not finite stops the run, naming it (check_teacher_logp)."""
    how = dict(micro=args.micro_batch_size, max_tokens=args.micro_batch_tokens, temperature=args.temperature)
    mask = batch["response_mask"]
    with timed(timing, "teacher"):
        scored = teacher_batch(batch, [r["teacher_prompt_ids"] for r in samples]) if args.teacher_prompt_key else batch
        if args.distill_loss == "forward_kl_topk":
            vocab = policy.config.vocab_size  # the ids the student can produce
            teacher_logp, *top = teacher_topk(
                policy, teacher, scored, k=distill_topk(args, vocab), vocab=vocab, device=device, **how
            )
            batch["teacher_topk_logp"], batch["teacher_topk_ids"] = top
        else:
            teacher_logp = reference_logprobs(policy, teacher, scored, device=device, **how)
    check_teacher_logp(teacher_logp, mask, args, device)
    if not teacher_in_loss(args):
        metrics = add_teacher_term(batch, teacher_logp, old, coef=args.distill_coef, reward=args.reward, device=device)
        return batch["advantages"][mask.bool()], metrics
    batch["teacher_logp"] = teacher_logp
    if not args.reward:  # pure distillation: the teacher's loss alone
        batch["advantages"] = torch.zeros_like(mask)
    return batch["advantages"][mask.bool()], teacher_metrics(teacher_logp, old, mask, device)


@torch.no_grad()
def teacher_topk(policy, teacher, scored, *, k, vocab, micro, max_tokens, temperature, device):
    """forward_kl_topk's teacher pass, micro-batch by micro-batch: at each response token the teacher's log-prob of
    the sampled token and its k most likely tokens' log-probs and ids, ([N, R], [N, R, k], [N, R, k]), made inside
    the fused head's blocks (logprobs.head_topk_logprobs: a block's top k merged into a running top k, never a
    [tokens, V] tensor); a head that is not a plain linear layer goes through its logits. Only the first `vocab`
    rows compete (a teacher with more rows never proposes an id the student cannot produce). teacher None: the
    LoRA policy's base, as policy.reference_logprobs scores it."""
    model, (N, R) = policy if teacher is None else teacher, scored["response_mask"].shape
    if k > vocab:
        raise SystemExit(f"--distill-topk {k}: more than the student's {vocab} vocabulary entries; use at most {vocab}")
    out = torch.zeros(N, R), torch.zeros(N, R, k), torch.zeros(N, R, k, dtype=torch.long)
    with lora.reference_mode(policy) if teacher is None else contextlib.nullcontext():
        for rows in micro_batches(scored, list(range(N)), micro, max_tokens):
            mb = micro_batch(scored, rows)
            labels = mb["responses"].to(device)
            if fusable_head(model) is not None:
                head = lambda h, w: head_topk_logprobs(h, w[:vocab], labels, k, temperature)  # noqa: B023, E731
                got = run_head(model, mb, device, head)
            else:
                logp = torch.log_softmax(response_logits(model, mb, device)[..., :vocab].float() / temperature, -1)
                got = (logp.gather(-1, labels[..., None]).squeeze(-1), *logp.topk(k, -1))
            for whole, part in zip(out, got):
                whole[rows, : labels.shape[1]] = part.cpu()
        reshard(model)
    return out


def check_teacher_logp(teacher_logp, mask, args, device):
    """The teacher's log-probs on every rank's model tokens are finite, or a SystemExit naming the teacher: a
    teacher with NaN or inf weights would otherwise turn every update non-finite, and the run would stop as if
    the student's --lr had diverged."""
    bad = int(all_sum(int((~torch.isfinite(teacher_logp[mask.bool()])).sum()), device))
    if bad:
        raise SystemExit(
            f"--teacher {args.teacher}: {bad} of the student's tokens got a non-finite teacher log-prob (NaN or inf): "
            "the teacher's weights or its outputs are not finite. Check the teacher directory (a model exported "
            "from a diverged run?) or pick another --teacher"
        )


def teacher_batch(batch, teacher_prompts):
    """OPSD: the batch the teacher scores, each row's teacher prompt ids followed by the student's response
    ids exactly as sampled (never decoded and re-tokenized, as multi_turn.py keeps them): the same
    response columns, so its log-probs line up with the student's [N, R]. Padding is masked out by the
    attention mask, so its id does not matter."""
    lens = batch["response_lens"]
    responses = [batch["responses"][i, : lens[i]].tolist() for i in range(len(lens))]
    return make_batch(teacher_prompts, responses, pad_id=0, group=batch.get("group", 1))


# ----------------------------------------------------------------------------------------------
# Setup: the teacher's checks, its prompts, loading it


def check_teacher(args):
    """Before anything loads: --teacher is a model directory (model_dir.check_model_path's message) whose
    tokenizer is the student's, the same tokens at the same ids (the teacher scores the student's ids),
    and whose vocabulary covers the student's. SystemExit naming the first difference. And --distill-topk fits
    the student's vocabulary (check_topk)."""
    check_topk(args)
    if args.teacher == SELF:
        return
    try:
        check_model_path(args.teacher)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--teacher: {e}") from None
    problem = vocabulary_difference(args.model, args.teacher)
    if problem:
        raise SystemExit(
            f"--teacher {args.teacher}: {problem}. On-policy distillation scores the student's token ids with the "
            "teacher, so both must share one tokenizer: pick a teacher of --model's family (the same tokenizer)"
        )


TOPK = 32  # --distill-topk's default (config.Args.distill_topk): not given, it is at most the student's vocabulary


def distill_topk(args, vocab):
    """forward_kl_topk's k for a student of `vocab` vocabulary entries: --distill-topk, or for the default (the flag
    not given, or given as 32) at most `vocab`: the demo's tiny model has 20 words."""
    return min(args.distill_topk, vocab) if args.distill_topk == TOPK else args.distill_topk


def check_topk(args):
    """forward_kl_topk, before anything loads: a --distill-topk above the student's vocabulary (its config.json's
    vocab_size) is a SystemExit naming both; the default above it is lowered to it (distill_topk), said once.
    A hub id's vocabulary is not known yet: teacher_topk checks k at the first step."""
    path = os.path.join(args.model, "config.json")
    if args.distill_loss != "forward_kl_topk" or not os.path.isfile(path):
        return
    vocab = json.load(open(path)).get("vocab_size")
    if vocab is None or args.distill_topk <= vocab:
        return
    if args.distill_topk != TOPK:
        raise SystemExit(
            f"--distill-topk {args.distill_topk}: more than the student's {vocab} vocabulary entries ({path}); use "
            f"at most {vocab}, or leave the flag out for min({TOPK}, its vocabulary)"
        )
    print0(f"--distill-topk: the student has {vocab} vocabulary entries, fewer than the default {TOPK}: each position compares all {vocab}")  # fmt: skip


def vocabulary_difference(student, teacher):
    """The first difference between two model directories' tokenizers (token -> id, added tokens
    included) and their models' vocabulary sizes, as a sentence; None when the teacher can score every
    id the student can sample. Reads the tokenizers and config.json, never the weights."""
    from transformers import AutoTokenizer

    vocabs = [AutoTokenizer.from_pretrained(p, trust_remote_code=False).get_vocab() for p in (student, teacher)]
    by_id = [{i: t for t, i in v.items()} for v in vocabs]
    for i in sorted(set(by_id[0]) | set(by_id[1])):
        a, b = by_id[0].get(i), by_id[1].get(i)
        if a != b:
            return f"token id {i} is {a!r} in --model's tokenizer and {b!r} in the teacher's ({len(vocabs[0])} and {len(vocabs[1])} tokens)"
    sizes = [json.load(open(os.path.join(p, "config.json"))).get("vocab_size") for p in (student, teacher)]
    if None not in sizes and sizes[1] < sizes[0]:
        return f"its model has {sizes[1]} vocabulary rows and --model's {sizes[0]}: it cannot score every id the student samples"
    return None


def teacher_prompts(args, tokenizer, rows):
    """OPSD (--teacher-prompt-key KEY): each row's teacher prompt, row[KEY] or row["extra_info"][KEY] (chat
    messages, or a string taken as one user message), rendered like the student's prompt into
    row["teacher_prompt_ids"]. A row without it is a SystemExit naming the row and the key."""
    key = args.teacher_prompt_key
    for i, row in enumerate(rows if key else []):
        value = row.get(key, (row.get("extra_info") or {}).get(key))
        if isinstance(value, str):
            value = [{"role": "user", "content": value}]
        if not (isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value)):
            raise SystemExit(
                f"{args.train_data}: row {i} has no teacher prompt {key!r} (--teacher-prompt-key): expected a column "
                f"or extra_info key {key!r} holding chat messages or a string, got {value!r:.80}"
            )
        row["teacher_prompt_ids"] = tokenizer.apply_chat_template(
            value, add_generation_prompt=True, tokenize=True, return_dict=False
        )


def fitting_teacher_prompts(args, rows):
    """The rows whose teacher prompt (teacher_prompts) and a longest response fit the teacher's positions
    (teacher_prompt_limit); the others are dropped and counted, as prompts longer than --max-prompt-length are.
    Fewer rows left than --prompt-batch-size: a SystemExit. Without --teacher-prompt-key: the rows as they are."""
    key = args.teacher_prompt_key
    if not key:
        return rows
    limit, why = teacher_prompt_limit(args)
    kept = [r for r in rows if len(r["teacher_prompt_ids"]) <= limit]
    if len(kept) < len(rows):
        print0(f"train data: dropped {len(rows) - len(kept)} of {len(rows)} rows whose teacher prompt ({key!r}) is longer than {limit} tokens ({why})")  # fmt: skip
    if len(kept) < args.prompt_batch_size:
        raise SystemExit(
            f"{args.train_data}: {len(kept)} rows with a teacher prompt ({key!r}) of at most {limit} tokens ({why}), "
            f"fewer than --prompt-batch-size {args.prompt_batch_size}: shorten the teacher prompts"
        )
    return kept


def teacher_prompt_limit(args):
    """(The most tokens a teacher prompt may hold, why): the teacher's context length (model_dir.context_length of
    --teacher, or --model's for self) less --max-response-length, since the teacher reads its prompt and then a
    whole response; --max-prompt-length where the context length is unknown (a hub id)."""
    path = args.model if args.teacher == SELF else args.teacher
    context, source = context_length(path)
    if context is None:
        return args.max_prompt_length, "--max-prompt-length; the teacher's context length is unknown"
    limit = context - args.max_response_length
    return limit, f"the teacher's {context} positions ({source}) less --max-response-length {args.max_response_length}"


def load_teacher(args, policy, reference, *, mesh, device, dtype):
    """The model that scores as the teacher (for policy.reference_logprobs): `self`, the current policy; the
    --model directory itself, the frozen initial policy, which is the reference copy when --kl-coef loaded
    one, and with LoRA the base (None: the policy with its adapters off, no copy); any other directory, a
    frozen FSDP2 copy in the run's dtype, loaded as the reference is (policy.load_frozen)."""
    if args.teacher == SELF:
        return policy
    if os.path.realpath(args.teacher) == os.path.realpath(args.model):
        if args.lora_rank:
            return None
        if reference is not None:
            return reference
    return load_frozen(args.teacher, mesh, device, dtype, offload=args.offload in ("params", "both"))


def teacher_fingerprint(args, teacher):
    """One number that identifies a frozen teacher's weights (lora.base_fingerprint's sums), kept in every
    checkpoint: the teacher is never saved, so checkpoint.check_teacher refuses to resume with other weights at
    the same path. None for `self` (the policy, checkpointed) and for LoRA's base (None: its own fingerprint)."""
    if teacher is None or args.teacher == SELF:
        return None
    return lora.base_fingerprint(teacher)


def prompt_only_rows(args, rows):
    """Pure distillation (--no-reward) on a prompt-only dataset without --reward-fn: there is no reward to compute,
    so each row gets data_source PROMPT_ONLY_SOURCE and no ground truth, which labelled_reward scores 0 (critic/score is
    then 0 throughout), said once at start-up; where it was a verl-signature function with nothing to read at step
    1. Rows of verl's schema, and runs with a reward or a --reward-fn, are left as they are."""
    if args.reward or args.reward_fn or not rows or all(c in rows[0] for c in VERL_COLUMNS):
        return
    for row in rows:
        row.setdefault("data_source", PROMPT_ONLY_SOURCE)
        row.setdefault("reward_model", {"ground_truth": None})
    print0(
        f"{args.train_data}: a prompt-only dataset with --no-reward and no --reward-fn: the teacher's term alone "
        "trains, and critic/score is 0 (a --reward-fn FILE:FUNCTION would log a score beside it)"
    )


def labelled_reward(data_source, solution_str, ground_truth, extra_info=None):
    """--no-reward's score (verl's signature), logged but never trained on: the built-in reward where a row
    has a ground truth and a built-in data_source, else 0 (pure distillation's rows need neither)."""
    if ground_truth is None or data_source not in BUILTIN_SOURCES:
        return 0.0
    return compute_score(data_source, solution_str, ground_truth, extra_info)
