"""GRPO post-training of a causal LM: FSDP2 policy, a vLLM engine colocated in every rank.

    torchrun --nproc_per_node=1 train_grpo.py                  # the demo: tiny local model, synthetic task
    torchrun --nproc_per_node=8 train_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct \\
        --train-data data/gsm8k/train.parquet --val-data data/gsm8k/test.parquet

Every step: sample a global batch of prompts (sharded over ranks) -> generate n responses per
prompt with the rollout engine -> score them -> group-normalized advantages -> old log-probs
(recomputed by the trainer) and reference log-probs -> ppo_epochs x mini-batches x micro-batches
of the clipped surrogate + KL loss -> AdamW step -> copy the new weights into the engine ->
log -> validate -> checkpoint. After a crash, the same command resumes exactly (checkpoint.py).
Signals leaving their healthy band print one-line warnings as they happen, and every run ends
with a health report in <out-dir>/report/ (health.py).

This file is the story; each idea it uses has a file of its own: the flags (config.py), the
engine (rollout.py), rewards (reward.py), advantages (advantage.py), the loss (loss.py), the
policy's batches, log-probs and sharding (policy.py), validation (eval.py), the run's log and
metrics (run_log.py), checkpoints (checkpoint.py) and the process group (distributed.py).

What is kept from verl's GRPO: its data schema, formulas (loss.py, advantage.py), defaults
(clip 0.2, k3 KL loss with coefficient 0.001, token-mean, lr 1e-6) and metric names. What is
dropped: a critic (GRPO needs none), KL in the reward (we use the KL loss, as verl's GRPO
examples do), multi-turn rollouts and sequence packing.
"""

import os

# Large CPU tensors in 2 MiB transparent huge pages: torch's CPU allocator asks the kernel for them
# (madvise) when this variable is set, before its first large allocation. Every micro-batch allocates
# tensors of [vocab, hidden] (the tied embedding's and the head's gradients, FSDP2's gathered weights);
# in 4 KiB pages each costs one page fault per page (BENCHMARKS.md, the Qwen-vocabulary section).
# No effect on GPU tensors, nor where the kernel's huge pages are off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import dataclasses
import json
import math
import random
import sys
import textwrap
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

import checkpoint
import data_prep
import health
import lora
import reward_model
from advantage import compute_advantages
from config import DEMO_OVERRIDES, allowed_changes, loggers, parse_args, reward_specs, reward_weights
from distributed import (
    all_gather,
    all_sum,
    all_sum_tensor,
    catch_stop_signals,
    full_tensor,
    init_distributed,
    is_peer_failure,
    print0,
    record_root_cause,
    reduce_metrics,
    stop_requested,
)
from eval import samples_table, validate
from loss import GSPO_AGG, agg_denominator, agg_loss, kl_penalty, policy_loss
from policy import (
    activation_gib_per_token,
    compute_dtype,
    compute_logprobs,
    load_policy,
    make_batch,
    micro_batches,
    move_optimizer_states,
    reference_logprobs,
    response_logprobs,
    save_hf,
    sync_weights,
    update_may_overflow,
    window,
)
from reward import BUILTIN_SOURCES, compute_score, load_reward_fns, overlong_penalty, response_text, score_rows
from rollout import Rollout, check_model_path, make_engine, sampling_seeds, stop_token_ids
from run_log import (
    RunLog,
    engine_gap_metrics,
    free_memory_gib,
    is_best,
    loss_metrics,
    memory_gb,
    rollout_metrics,
    sample_records,
    should_stop,
    timed,
)

# ----------------------------------------------------------------------------------------------
# Setup: the run directory, the demo's inputs, the data, the engine, resuming


def claim_run_dir(args, rank):
    """The run directory is ours alone, and a resume continues the same run: decided by rank 0
    before anything in it is written, and told to every rank. Returns (the checkpoint to resume
    from or None, the directory's lock: hold it until the process exits)."""
    decision, lock = [None, None], None  # [checkpoint to resume from, why this run may not use the directory]
    if rank == 0:
        try:
            lock = checkpoint.lock_run_dir(args.out_dir)
            config, allowed = dataclasses.asdict(args), allowed_changes(args)
            decision[0] = checkpoint.check_run_dir(args.out_dir, args.resume, config, allowed)
        except SystemExit as e:
            decision[1] = str(e)
    dist.broadcast_object_list(decision, src=0)
    if decision[1]:
        raise SystemExit(decision[1])
    os.makedirs(os.path.join(args.out_dir, "samples"), exist_ok=True)
    return decision[0], lock


def demo_inputs(args, rank):
    """The demo makes its own inputs, on rank 0: the tiny model for --model tiny, the synthetic task
    for an empty --train-data or --val-data. Points args at them."""
    if args.model == "tiny":
        changed = ", ".join(f"{k}={v}" for k, v in DEMO_OVERRIDES.items() if getattr(args, k) == v)
        print0(f"demo: the tiny model learns from scratch, so these replace verl's fine-tuning defaults: {changed}")
        from models import build_tiny_model

        args.model = os.path.join(args.out_dir, "tiny_model")
        if rank == 0:
            build_tiny_model(args.model, data_prep.TASK_WORDS, seed=args.seed)
    if not args.train_data or not args.val_data:
        task_dir = os.path.join(args.out_dir, "data")
        if rank == 0:
            data_prep.write_task(task_dir, seed=args.seed)
        args.train_data = args.train_data or os.path.join(task_dir, "train.parquet")
        args.val_data = args.val_data or os.path.join(task_dir, "test.parquet")
    dist.barrier()


def load_data(args, tokenizer):
    """The training and validation rows of verl's schema with their prompt token ids (row["prompt_ids"]);
    prompts longer than --max-prompt-length are dropped and counted."""
    known = None if args.reward_fn else BUILTIN_SOURCES  # without --reward-fn, every row needs a built-in reward
    out = []
    for path, name in ((args.train_data, "train data"), (args.val_data, "validation data")):
        try:
            rows, dropped = data_prep.load_prompts(path, tokenizer, known, args.max_prompt_length)
        except data_prep.DataError as e:  # names the file, row and field: the message is the error
            raise SystemExit(str(e)) from None
        if dropped:
            limit = f"max_prompt_length={args.max_prompt_length}"
            print0(f"{name}: dropped {dropped} of {len(rows) + dropped} prompts longer than {limit} tokens")
        out.append(rows)
    train_rows, val_rows = out[0], out[1][: args.val_max_prompts if args.val_max_prompts > 0 else None]
    if len(train_rows) < args.prompt_batch_size:
        batch = f"prompt_batch_size={args.prompt_batch_size}"
        raise SystemExit(f"{args.train_data}: {len(train_rows)} usable prompts, fewer than {batch}")
    return train_rows, val_rows


def check_update_memory(args, policy, trained, world, ranks_here, device, kv_cache_gib=None):
    """Before the first rollout: does the update's largest micro-batch fit? Its activations (measured
    per token on this model, policy.activation_gib_per_token) plus the gradients and AdamW's two
    states, against the memory this rank has free now. Printed as a warning when it does not, with
    flags that fit: otherwise the run would die in its first update, after a whole rollout."""
    free = free_memory_gib(device, ranks_here)
    if free is None:
        return
    p, r = args.max_prompt_length, args.max_response_length
    n = args.group_size if args.share_prompts else 1
    unit = p + n * r  # the smallest micro-batch (policy.micro_batches): a group with its prompt, or one sequence
    if args.micro_batch_tokens:
        tokens = max(args.micro_batch_tokens, unit)
    else:
        tokens = max(1, args.micro_batch_size // n) * unit
    per_token = activation_gib_per_token(policy, device, min(p + r, 1024))
    on_gpu = {"none": 3, "optimizer": 1, "params": 0, "both": 0}[args.offload]  # grads + 2 AdamW moments
    states = on_gpu * sum(x.numel() * x.element_size() for x in trained) / world / 2**30
    need = per_token * tokens + states
    if need <= free or per_token <= 0:
        return
    fits = int((free - states) * 0.8 / per_token) // 1024 * 1024  # tokens, with a fifth to spare
    if fits >= unit:
        fix = f"--micro-batch-tokens {fits}"
    elif fits >= p + r:  # shared prompts: a micro-batch holds a whole group
        fix = f"--micro-batch-tokens {fits} --no-share-prompts (with shared prompts a group is {unit} tokens)"
    else:
        fix = "--grad-checkpointing (it keeps one layer's activations at a time)"
    if kv_cache_gib:  # on CPU the engine keeps its KV cache while training
        fix += (
            f". The rollout engine's KV cache takes {kv_cache_gib:.1f} GiB of this rank's memory; "
            "VLLM_CPU_KVCACHE_SPACE=<GiB> in the environment sets it"
        )
    print0(
        f"memory: the update's largest micro-batch ({tokens} tokens) needs about {need:.1f} GiB "
        f"({per_token * 2**20:.0f} KiB of activations per token, {states:.1f} GiB of gradients and optimizer "
        f"states), and this rank has {free:.1f} GiB free: the first update would likely run out of memory. "
        f"Smaller micro-batches give the same gradient: {fix}."
    )


def start_engine(args, world, ranks_here, device, dtype):
    """The rollout engine for --rollout, computing in `dtype` (the policy's: --dtype)."""
    return make_engine(
        args.rollout,
        args.model,
        max_model_len=args.max_prompt_length + args.max_response_length,
        dtype=str(dtype).removeprefix("torch."),
        seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed=True,
        device=device,
        verbose=args.verbose,
        max_batch_size=args.prompt_batch_size // world * args.group_size,  # HFEngine: a step's rollout in one batch
        sequences=args.prompt_batch_size // world * args.group_size,  # vLLM's KV cache on CPU: the same rollout
        memory_gib=free_memory_gib(device, ranks_here),
    )


def lr_factor(step, args, total_steps):
    """The learning rate at `step` as a fraction of --lr: linear warmup, then constant or cosine."""
    if step < args.warmup_steps:
        return (step + 1) / (args.warmup_steps + 1)
    if args.lr_schedule == "cosine":
        progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


def resume(path, args, policy, optimizer, scheduler, total_steps, base_fingerprint=None):
    """Load a checkpoint into the policy, optimizer and scheduler; returns (its step, the metric
    history). LoRA adapters on another base model are refused."""
    state = checkpoint.load(path, policy, optimizer, dataclasses.asdict(args))
    lora.check_fingerprint(state.get("base_fingerprint"), base_fingerprint, f"{path} (--model {args.model})")
    scheduler.load_state_dict(state["scheduler"])
    step, history = state["step"], state["metrics"]
    if {"lr", "weight_decay"} & allowed_changes(args):  # the restored optimizer and scheduler hold the old ones
        scheduler.base_lrs = [args.lr] * len(optimizer.param_groups)
        for group in optimizer.param_groups:
            group["initial_lr"], group["weight_decay"] = args.lr, args.weight_decay
            group["lr"] = args.lr * scheduler.lr_lambdas[0](scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what actor/lr reports
    return step, history


def end_a_finished_run(path, args, total_steps, rank):
    """Before the engine loads: if the checkpoint at `path` ends the run (its last step, or an early
    stop), there is nothing to train, and the process ends here. A finished run whose final model is
    missing (it was killed while writing it) gets it now, exported from that checkpoint."""
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    step, history = state["step"], state["metrics"]
    if step < total_steps and not should_stop(history, args.early_stop_metric, args.early_stop_patience):
        return
    how = "early-stopped" if step < total_steps else f"of {total_steps}"
    problem = checkpoint.final_model_problem(args.out_dir, path) if args.save_model else None
    if problem is None:
        raise SystemExit(
            f"{args.out_dir}: this run has finished (step {step}, {how}). "
            "Raise --max-steps or --epochs to train it further, or pass a new --out-dir for a new run."
        )
    print0(f"{args.out_dir}: this run finished (step {step}, {how}), but {problem}; exporting it from {path}")
    if rank == 0:  # one process reads the whole checkpoint, whatever number of ranks wrote it
        adapter = os.path.join(args.out_dir, "final_adapter") if args.lora_rank else None
        checkpoint.export(path, os.path.join(args.out_dir, "final_model"), base=args.model, adapter_dir=adapter)
        report, verdicts = health.write_report(args.out_dir)
        print0(f"health report: {report}: {verdicts['overall']}")
    dist.barrier()
    raise SystemExit(0)


def save_checkpoint(
    checkpointer, step, args, train_rows, policy, optimizer, scheduler, config, log, fingerprint, tokenizer
):
    """Everything needed to continue this run exactly from after `step` (checkpoint.Checkpointer)."""
    epoch = max(step - 1, 0) // (len(train_rows) // args.prompt_batch_size)
    trainer_state = dict(epoch=epoch, scheduler=scheduler.state_dict(), config=config, metrics=log.history)
    trainer_state["base_fingerprint"] = fingerprint
    checkpointer.save(step, policy, optimizer, trainer_state, tokenizer)


# ----------------------------------------------------------------------------------------------
# One step's pieces: prompts, validation, the loss, the update


def step_prompts(train_rows, step, batch, args, rank, world):
    """This rank's prompts in generation batch `batch` (0, then 1, 2, ... with --filter-groups) of
    `step` (from 1): its share of a global batch. Batch 0 walks the epoch in an order shuffled by
    (seed, epoch), so resuming needs nothing saved; further batches draw prompts from a shuffle seeded
    by (seed, step, batch). Returns (indices into train_rows, the place of this rank's first prompt)."""
    epoch, index_in_epoch = divmod(step - 1, len(train_rows) // args.prompt_batch_size)
    seed = args.seed + epoch if batch == 0 else args.seed * 1_000_003 + step * 1_009 + batch
    order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(seed)).tolist()
    local = args.prompt_batch_size // world
    first = (index_in_epoch if batch == 0 else 0) * args.prompt_batch_size + rank * local
    return order[first : first + local], rank * local


def score_samples(reward, samples, texts, out, first, args, device, where=""):
    """The rewards of one generation batch on this rank: the reward functions (which also see each
    response's token ids and whether it was cut off), plus the reward model's score (--reward-model),
    plus DAPO's overlong punishment. `reward` is (reward function, (reward model, its tokenizer) or None);
    reward errors name the sample as "{where}, sample {first + i} of the batch" (reward.score_rows).
    Returns (scores, extras: the logged parts, one value per sample)."""
    reward_fn, rm = reward
    kw = dict(response_ids=out.response_ids, truncated=out.truncated, errors=args.reward_errors, where=where)
    scores, extras = score_rows(reward_fn, samples, texts, first=first, **kw)
    if rm is not None:  # reward = rule + w x model, or w x model alone
        extras["rule"] = scores
        extras["reward_model"] = reward_model.score(*rm, samples, texts, args.micro_batch_size, device)
        w = args.reward_model_weight
        scores = [w * m + (0.0 if args.reward_model_only else s) for s, m in zip(scores, extras["reward_model"])]
    if args.overlong_buffer_len > 0:  # DAPO: long responses lose up to the factor, linearly
        limits = (args.max_response_length, args.overlong_buffer_len, args.overlong_penalty_factor)
        extras["overlong_penalty"] = overlong_penalty([len(ids) for ids in out.response_ids], *limits)
        scores = [s + p for s, p in zip(scores, extras["overlong_penalty"])]
    return scores, extras


def collect_groups(engine, train_rows, step, args, rank, world, tokenizer, reward, eos_ids, timing, device):
    """This step's samples on this rank: n responses to each of its prompts, seeded by the prompt's
    place in the global batch, their texts and rewards (with the overlong punishment, if on).

    With --filter-groups (DAPO's dynamic sampling), groups whose rewards are all equal are dropped and
    further batches of prompts are generated until prompt_batch_size informative groups are held, or
    --max-gen-batches ran out: then the step trains on what it has, its informative groups repeated to
    fill the batch (each counts more; filter/* says so). The groups are dealt out to the ranks in their
    global order, so 1 and 2 ranks train on the same ones. Returns (rows, Rollout, texts, scores, extras, filter metrics)."""
    n, local, pool = args.group_size, args.prompt_batch_size // world, {}
    for batch in range(args.max_gen_batches if args.filter_groups else 1):
        indices, first = step_prompts(train_rows, step, batch, args, rank, world)
        rows = [train_rows[i] for i in indices]
        with timed(timing, "gen"):
            engine.wake_up()
            kw = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, logprobs=args.engine_logprobs)
            seeds = sampling_seeds(args.seed, step, batch * args.prompt_batch_size + first, len(rows))
            prompts, max_new = [r["prompt_ids"] for r in rows], args.max_response_length
            out = engine.generate(prompts, n=n, max_new_tokens=max_new, seeds=seeds, **kw)
            engine.sleep()
        with timed(timing, "reward"):
            samples = [r for r in rows for _ in range(n)]  # prompt-major, like the rollout
            texts = [response_text(tokenizer, ids, eos_ids) for ids in out.response_ids]
            place = first * n  # for error messages: the sample's place in this generation batch, all ranks'
            where = f"step {step}" + (f", generation batch {batch + 1}" if batch else "")
            scores, extras = score_samples(reward, samples, texts, out, place, args, device, where)
        if not args.filter_groups:
            return rows, out, texts, scores, extras, {}
        # every rank's samples, as columns in global order, added to those of earlier batches
        mine = dict(row=[i for i in indices for _ in range(n)], ids=out.response_ids, text=texts, score=scores)
        mine.update(truncated=out.truncated, logp=out.logprobs or [[]] * len(texts))
        mine["extra"] = [{k: v[i] for k, v in extras.items()} for i in range(len(texts))]  # keys may differ by rank
        pool = {k: pool.get(k, []) + sum((part[k] for part in all_gather(mine)), []) for k in mine}
        groups = [pool["score"][g : g + n] for g in range(0, len(pool["score"]), n)]
        informative = [g for g, group in enumerate(groups) if len(set(group)) > 1]
        if len(informative) >= args.prompt_batch_size:
            break
    uninformative = sorted(set(range(len(groups))) - set(informative))
    have = informative or uninformative  # nothing informative at all: a step with nothing to learn
    chosen = [have[i % len(have)] for i in range(args.prompt_batch_size)][rank * local : (rank + 1) * local]
    mine = {k: [v[g * n + j] for g in chosen for j in range(n)] for k, v in pool.items()}  # this rank's share
    out = Rollout(mine["ids"], mine["logp"] if args.engine_logprobs else [], mine["truncated"])
    extras = {k: [e.get(k) for e in mine["extra"]] for k in sorted({k for e in mine["extra"] for k in e})}
    metrics = {"filter/kept_groups": min(len(informative), args.prompt_batch_size)}
    metrics.update({"filter/dropped_groups": len(uninformative), "filter/gen_batches": batch + 1})
    return [train_rows[i] for i in mine["row"][::n]], out, mine["text"], mine["score"], extras, metrics


def run_validation(step, engine, val_rows, tokenizer, reward_fn, eos_ids, args, rank, world, log):
    """eval.validate on the validation prompts; its samples go to the run's log. Returns the metrics."""
    engine.wake_up()
    kw = dict(n=args.val_n, temperature=args.val_temperature, max_new_tokens=args.max_response_length, seed=args.seed)
    kw.update(errors=args.reward_errors, where=f"validation at step {step}")
    metrics, samples = validate(engine, val_rows, tokenizer, reward_fn, eos_ids, rank=rank, world=world, **kw)
    engine.sleep()
    log.samples(f"val_step_{step}.jsonl", step, samples, mode="w", table="val/generations")
    if step == 0:  # once, so the console shows what the prompts and responses look like
        log.write(f"validation samples, step 0:\n{samples_table(samples[:5])}")
    return metrics


def keep_best(history, args, policy, tokenizer, rank):
    """With --early-stop-metric: check the metric exists; save the policy whenever it is the best so far."""
    if not args.early_stop_metric:
        return
    if args.early_stop_metric not in history[-1]:
        names = sorted(k for k in history[-1] if k.startswith("val-"))
        raise SystemExit(f"--early-stop-metric {args.early_stop_metric}: no such validation metric; there are {names}")
    if is_best(history, args.early_stop_metric):
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        save_hf(
            policy, tokenizer, os.path.join(args.out_dir, "best_model"), rank, step=history[-1]["step"], dtype=dtype
        )


def micro_batch_loss(policy, view, rows, adv_tokens, old_logp, ref_logp, engine_logp, agg, args, device):
    """The loss of one micro-batch (`view`: policy.window of the batch at `rows`): the clipped
    surrogate (--loss-mode), + kl_coef x the KL to the reference, - entropy_coef x the entropy, each
    aggregated by `agg`. Returns (loss, {name: number} of every term for the log, old log-probs [b, r])."""
    m, r = view["response_mask"].to(device), view["responses"].shape[1]  # [b, r]
    # [b, r] each; the head and softmax run a block at a time, never the whole [b, r, V]
    logp, token_entropy = response_logprobs(policy, view, device, args.temperature, entropy_grad=args.entropy_coef > 0)
    old = logp.detach() if old_logp is None else old_logp[rows, :r].to(device)  # on-policy: ratio 1
    is_weights = None
    if args.tis_cap > 0:  # truncated importance sampling: the engine sampled, the trainer scores
        is_weights = torch.exp(old - engine_logp[rows, :r].to(device)).clamp(max=args.tis_cap) * m
    adv = adv_tokens[rows, :r].to(device)  # [b, r]
    norm_len = args.loss_scale_factor or args.max_response_length  # Dr. GRPO's constant, never the window's width
    pg_loss, pg_metrics = policy_loss(
        logp, old, adv, m, args.clip_low, args.clip_high, args.clip_c, agg, is_weights, norm_len, mode=args.loss_mode
    )
    loss, kl_loss = pg_loss, torch.zeros(())
    if ref_logp is not None:
        kl_loss = agg_loss(kl_penalty(logp, ref_logp[rows, :r].to(device), args.kl_kind), m, agg, norm_len)
        loss = loss + args.kl_coef * kl_loss
    entropy = agg_loss(token_entropy, m, agg, norm_len)
    if args.entropy_coef > 0:
        loss = loss - args.entropy_coef * entropy
    terms = dict(pg_loss=pg_loss, kl_loss=kl_loss, entropy=entropy, policy_loss=loss, **pg_metrics)
    return loss, {k: v.item() for k, v in terms.items()} | {"tokens": m.sum().item()}, old


def update_policy(step, policy, optimizer, batch, adv_tokens, old_logp, ref_logp, engine_logp, args, world, device):
    """ppo_epochs x mini-batches x micro-batches of the loss, one optimizer step per mini-batch.
    Returns (stats: each micro-batch's loss terms, grad_norm on each mini-batch's last; the
    trainer's log-probs of the sampled tokens [N, R]; how many optimizer steps were skipped)."""
    mask = batch["response_mask"]  # [N, R]
    agg = GSPO_AGG if args.loss_mode == "gspo" else args.loss_agg  # GSPO's loss is a mean over sequences
    mini_local = args.mini_batch_size // world * args.group_size  # sequences per optimizer step on this rank
    stats, trainer_logp, skipped = [], torch.zeros_like(mask), 0
    policy.train()
    for _ in range(args.ppo_epochs):
        for m0 in range(0, mask.shape[0], mini_local):
            rows = list(range(m0, min(m0 + mini_local, mask.shape[0])))
            # each micro-batch's loss is weighted so the summed gradient is agg_loss over the whole
            # global mini-batch; FSDP averages gradients over ranks, hence the * world
            whole = all_sum(agg_denominator(mask[rows], agg), device)
            optimizer.zero_grad(set_to_none=True)
            for mb in micro_batches(batch, rows, args.micro_batch_size, args.micro_batch_tokens):
                view = window(batch, mb)  # only the columns these rows use
                loss, terms, old = micro_batch_loss(
                    policy, view, mb, adv_tokens, old_logp, ref_logp, engine_logp, agg, args, device
                )
                if args.engine_logprobs:  # for the engine-vs-trainer gap; a device sync, so only when asked
                    trainer_logp[mb, : old.shape[1]] = old.float().cpu()
                piece = agg_denominator(view["response_mask"], agg)
                (loss * (piece / max(whole, 1) * world)).backward()
                checkpoint.crash_point("update", step)
                stats.append(terms)
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
            grad_norm = full_tensor(grad_norm).item()
            if not math.isfinite(grad_norm):
                skipped += 1
                print0(f"step {step}: gradient norm is {grad_norm}; skipping this optimizer step")
            elif update_may_overflow(optimizer):  # a non-finite weight is never written, saved or synced
                skipped += 1
                print0(
                    f"step {step}: this update could make weights non-finite (lr {optimizer.param_groups[0]['lr']:.3g}); skipping it"
                )
            elif args.offload == "optimizer":  # the moments visit the GPU for the step only
                move_optimizer_states(optimizer, device)
                optimizer.step()
                move_optimizer_states(optimizer, "cpu")
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stats[-1]["grad_norm"] = grad_norm
    return stats, trainer_logp, skipped


# ----------------------------------------------------------------------------------------------


def main():
    args = parse_args()
    if not args.verbose:  # transformers' loading and saving bars would break ours
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()
    rank, world, device = init_distributed(args.collective_timeout)
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # read now: vLLM's CPU platform overwrites it
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    checkpoint.die_with_launcher()  # under torchrun: no orphan worker left writing into the run directory
    dtype, why = compute_dtype(args.dtype, device)  # resolved before the resume check: auto resumes a bf16 run
    args.dtype = "bf16" if dtype == torch.bfloat16 else "fp32"  # what the config, checkpoints and export record
    resume_from, run_lock = claim_run_dir(args, rank)  # noqa: F841 (held until the process exits)

    # ---------------- model and data: the demo makes its own; everything is checked before the engine loads
    demo_inputs(args, rank)
    try:  # a missing directory, weights or tokenizer, or a truncated download: named now, not by vLLM later
        check_model_path(args.model)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--model: {e}") from None
    from rollout import check_context_length

    try:  # vLLM's own error for this suggests VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, which gives NaN past the positions
        check_context_length(args.model, args.max_prompt_length, args.max_response_length)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.lora_rank:
        lora.check_targets(args.model, args.lora_target_modules)
    if args.reward_model:  # its directory is checked like the policy's, before anything loads
        reward_model.check_reward_model(args.reward_model)
    config = dataclasses.asdict(args)
    print0(f"compute dtype: {args.dtype} ({why})")
    print0(textwrap.fill("config: " + " ".join(f"{k}={v}" for k, v in config.items()), 120, subsequent_indent="  "))
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)
    except OSError as e:
        raise SystemExit(f"--model {args.model}: cannot load a tokenizer from it ({e})") from e
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = set(stop_token_ids(args.model))
    train_rows, val_rows = load_data(args, tokenizer)
    total_steps = args.epochs * (len(train_rows) // args.prompt_batch_size)
    total_steps = min(total_steps, args.max_steps) if args.max_steps > 0 else total_steps
    if resume_from:  # a finished run ends here, before the engine loads
        end_a_finished_run(resume_from, args, total_steps, rank)
    specs, timeout = reward_specs(args), args.reward_timeout  # --reward-fn runs in a worker process (reward.py)
    reward_fn = load_reward_fns(specs, reward_weights(args), timeout) if specs else compute_score

    # ---------------- the engine first (it sets the process's thread count), then the policy
    engine = start_engine(args, world, ranks_here, device, dtype)
    kv = getattr(engine, "kv_cache_tokens", None)
    print0(f"rollout engine: {type(engine).__name__}" + (f", KV cache of {kv:,} tokens" if kv else ""))
    catch_stop_signals()  # after the engine, which may set handlers of its own: SIGTERM/SIGINT now stop politely
    lora_args = (
        (args.lora_rank, args.lora_alpha, args.lora_target_modules, args.lora_dropout) if args.lora_rank else None
    )
    policy, reference = load_policy(
        args.model,
        mesh,
        device,
        dtype,
        args.grad_checkpointing,
        args.kl_coef > 0,
        lora_args,
        args.offload in ("params", "both"),
    )
    rm = reward_model.load_reward_model(args.reward_model, mesh, device, dtype) if args.reward_model else None
    reward = (reward_fn, rm)  # what score_samples needs
    base_fingerprint = lora.base_fingerprint(policy) if lora_args else None  # LoRA checkpoints hold no base weights
    engine.sleep()
    trained = [p for p in policy.parameters() if p.requires_grad]  # with LoRA, the adapters only
    check_update_memory(args, policy, trained, world, ranks_here, device, getattr(engine, "kv_cache_gib", None))
    optimizer = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, args=args, total_steps=total_steps))

    # ---------------- the run's log, and resume: the newest complete checkpoint, unless told otherwise
    monitor = health.Monitor(health.parse_bands(args.health_bands), total_steps)
    log = RunLog(args.out_dir, config, loggers(args), monitor, rank, args.wandb_project, args.wandb_run_name)
    checkpointer = None
    if args.save_freq > 0:
        checkpointer = checkpoint.Checkpointer(args.out_dir, args.max_ckpt_to_keep, args.async_save)
    start_step, history = 0, []
    if resume_from:
        start_step, history = resume(resume_from, args, policy, optimizer, scheduler, total_steps, base_fingerprint)
        sync_weights(engine, policy, dtype)
        print0(f"resumed from {resume_from} at step {start_step}")
    log.start(config, history, start_step, total_steps)
    validation = (engine, val_rows, tokenizer, reward_fn, eos_ids, args, rank, world, log)
    if args.val_before_train and args.test_freq > 0 and start_step == 0:
        log.log(0, run_validation(0, *validation))
        keep_best(log.history, args, policy, tokenizer, rank)

    # ---------------- the loop
    on_policy = args.ppo_epochs == 1 and args.mini_batch_size == args.prompt_batch_size
    optimizer_steps = args.ppo_epochs * (args.prompt_batch_size // args.mini_batch_size)  # per training step
    stop, done, saved, skipped_steps, asked = False, start_step, start_step, 0, stop_requested(device)
    for step in range(start_step + 1, total_steps + 1):
        if asked:  # SIGTERM or SIGINT: the steps done so far are saved after the loop
            break
        timing, t_step = {}, time.perf_counter()
        epoch = (step - 1) // (len(train_rows) // args.prompt_batch_size)
        rng_before = checkpoint.rng_state()  # what a checkpoint of step - 1 holds, if this step is abandoned

        # ---- rollout and reward: n responses per prompt (with --filter-groups, until enough groups differ)
        groups = collect_groups(engine, train_rows, step, args, rank, world, tokenizer, reward, eos_ids, timing, device)
        rows, out, texts, scores, extras, filter_metrics = groups
        checkpoint.crash_point("rollout", step)
        asked = stop_requested(device)
        if asked:  # the update has not started: abandon this step, as if it had never begun
            checkpoint.set_rng_state(rng_before)
            break
        samples = [r for r in rows for _ in range(args.group_size)]  # prompt-major, like the rollout

        # ---- advantages: each prompt's group lives on one rank (REINFORCE++ whitens over all ranks' tokens)
        group = args.group_size if args.share_prompts else 1  # shared: each prompt runs once per group
        batch = make_batch([r["prompt_ids"] for r in samples], out.response_ids, pad_id, group)
        mask = batch["response_mask"]  # [N, R]
        estimator = (args.group_size, args.adv_estimator, args.norm_adv_by_std)  # [N], or [N, R] for REINFORCE++
        advantages = compute_advantages(scores, *estimator, mask, total=partial(all_sum_tensor, device=device))
        adv_tokens = advantages if advantages.dim() == 2 else advantages[:, None] * mask  # [N, R]
        if args.mask_truncated:  # truncated responses count for nothing in the loss; the metrics still see them
            batch["response_mask"] = mask * ~torch.tensor(out.truncated)[:, None]
        engine_logp = torch.zeros_like(mask)  # [N, R]
        for i, lp in enumerate(out.logprobs):
            engine_logp[i, : len(lp)] = torch.tensor(lp)

        # ---- old and reference log-probs (on-policy, the old ones are the current ones: not recomputed)
        logprob_args = (batch, args.micro_batch_size, args.micro_batch_tokens, args.temperature, device)
        with timed(timing, "old_log_prob"):
            old_logp = None if on_policy else compute_logprobs(policy, *logprob_args)
        with timed(timing, "ref"):
            ref_logp = reference_logprobs(policy, reference, *logprob_args) if args.kl_coef > 0 else None

        # ---- policy update: ppo_epochs x mini-batches x micro-batches
        with timed(timing, "update_actor"):
            update = (step, policy, optimizer, batch, adv_tokens, old_logp, ref_logp, engine_logp, args, world, device)
            stats, trainer_logp, skipped = update_policy(*update)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
        skipped_steps = skipped_steps + 1 if skipped == optimizer_steps else 0

        # ---- copy the new weights into the engine
        with timed(timing, "update_weights"):
            sync_weights(engine, policy, dtype)
        timing["step"] = time.perf_counter() - t_step

        # ---- metrics, verl's names, reduced over ranks
        prompt_lens = [len(r["prompt_ids"]) for r in samples]
        metrics = {"actor/lr": lr, **loss_metrics(stats, device), **filter_metrics}
        adv_values = advantages[mask.bool()] if advantages.dim() == 2 else advantages  # per token, or per sample
        metrics.update(rollout_metrics(scores, adv_values, mask, prompt_lens, out.truncated, extras, args.group_size))
        if skipped:
            metrics["actor/skipped_updates"] = skipped
        if args.reward_errors == "skip":  # samples whose reward function failed, scored 0: all ranks
            metrics["reward/errors"] = all_sum(sum(extras["reward_error"]), device)
        if args.engine_logprobs:
            metrics.update(engine_gap_metrics(trainer_logp, engine_logp, mask))
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        tokens = mask.sum().item() + sum(prompt_lens)
        metrics["perf/total_num_tokens"] = all_sum(tokens, device)  # prompt + response tokens, all ranks
        metrics["perf/throughput"] = tokens / timing["step"]  # tokens/s per rank, as verl reports it
        metrics["perf/max_memory_allocated_gb"] = memory_gb(device)
        metrics = reduce_metrics(metrics, device)
        metrics["training/epoch"] = epoch

        # ---- validate, log, keep the best policy
        if args.test_freq > 0 and (step % args.test_freq == 0 or step == total_steps):
            with timed(timing, "testing"):
                metrics.update(run_validation(step, *validation))
            metrics["timing_s/testing"] = timing["testing"]
        histograms = {"critic/score": scores, "critic/advantages": adv_values.tolist()}
        log.log(step, metrics, histograms | {"response_length": mask.sum(-1).tolist()})
        if any(k.startswith("val-") for k in metrics):
            keep_best(log.history, args, policy, tokenizer, rank)
        first_group = slice(0, args.group_size)  # the first prompt's samples, for the reader
        log.samples("train.jsonl", step, sample_records(tokenizer, samples[first_group], texts, scores))

        # ---- checkpoint: everything needed to continue this run exactly
        stop = should_stop(log.history, args.early_stop_metric, args.early_stop_patience)
        if skipped_steps == MAX_SKIPPED_STEPS:  # nothing has changed since; the checkpoints hold finite weights
            raise SystemExit(
                f"steps {step - MAX_SKIPPED_STEPS + 1}-{step}: every update was skipped (a non-finite gradient, or an "
                f"update that would make weights non-finite): training has diverged. Lower --lr (now {args.lr:g}); "
                "to continue this run from its last checkpoint, rerun with --allow-changed lr."
            )
        done, asked = step, stop_requested(device)
        if checkpointer:
            checkpointer.poll()  # publish a finished background save now, not at the next save
            if step % args.save_freq == 0 or step == total_steps or stop or asked:
                state = (policy, optimizer, scheduler, config, log, base_fingerprint, tokenizer)
                save_checkpoint(checkpointer, step, args, train_rows, *state)
                saved = step
        if stop:
            patience = f"{args.early_stop_patience} validations"
            log.write(f"early stop at step {step}: {args.early_stop_metric} has not improved for {patience}")
            break
    if (
        asked and done < total_steps and not stop
    ):  # SIGTERM or SIGINT: keep what was done, say how to go on, exit non-zero
        if checkpointer and done > saved:
            state = (policy, optimizer, scheduler, config, log, base_fingerprint, tokenizer)
            save_checkpoint(checkpointer, done, args, train_rows, *state)
        if checkpointer:
            checkpointer.wait()
            where = f"{checkpoint.step_dir(args.out_dir, done)} holds it" if done else "nothing to save yet"
            message = f"stopped by {asked.name} after step {done} of {total_steps} ({where}): rerun the same command to continue"
        else:
            message = f"stopped by {asked.name} after step {done} of {total_steps}; --save-freq -1 wrote no checkpoint, so a rerun starts over"
        log.close()
        if rank == 0 and done > 0:
            health.write_report(args.out_dir)
        engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        record_root_cause(message)
        print0(message)
        sys.exit(128 + asked)  # the shell's convention for "ended by this signal": 143 for SIGTERM
    if checkpointer:
        checkpointer.wait()  # a background save must finish before we exit

    # ---------------- save the policy (never the reference) in Hugging Face format; the health report
    log.close()
    if args.save_model:
        if lora_args:  # first: a final_model of this step says that both are complete
            lora.save_adapter(policy, os.path.join(args.out_dir, "final_adapter"), rank)
            print0(f"saved the LoRA adapter to {os.path.join(args.out_dir, 'final_adapter')}")
        save_hf(
            policy, tokenizer, os.path.join(args.out_dir, "final_model"), rank, step=done, dtype=dtype
        )  # with LoRA: merged
        print0(f"saved the policy to {os.path.join(args.out_dir, 'final_model')}")
    if rank == 0:  # last, so nothing is lost if it fails: the end-of-run health report, from the run directory alone
        path, verdicts = health.write_report(args.out_dir)
        counts = ", ".join(f"{verdicts[k]} {k}" for k in ("problem", "watch", "healthy"))
        print0(f"health report: {path}: {verdicts['overall']} ({counts})")
    engine.close()  # before destroy_process_group, or vLLM's shutdown fails
    if dist.is_initialized():  # vLLM's shutdown may already have destroyed it
        dist.destroy_process_group()


MAX_SKIPPED_STEPS = 3  # steps in a row whose every update was skipped: the run has diverged; stop


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:  # our errors say what to do: under torchrun they are also its summary's last line
        if isinstance(e.code, str):
            record_root_cause(e.code)
        raise
    except (checkpoint.WriteError, checkpoint.NonFiniteError) as e:  # they name the path and what to do
        record_root_cause(str(e))
        raise SystemExit(str(e)) from None
    except Exception as e:
        if not is_peer_failure(e):
            record_root_cause(f"{type(e).__name__}: {e}")
            raise
        message = (
            f"rank {os.environ.get('RANK', 0)}: another rank stopped answering ({e}). It died or is stuck; its own "
            "output says why. Checkpoints are intact: rerun the same command to resume. If ranks legitimately wait "
            "longer than this for each other, raise --collective-timeout."
        )
        record_root_cause(message)
        raise SystemExit(message) from None
