"""GRPO post-training of a causal LM: the story, from the prompts to the checkpoint.

    torchrun --nproc_per_node=1 train_grpo.py      # the demo: a tiny local model learns a synthetic task
    torchrun --nproc_per_node=8 train_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct \\
        --train-data data/gsm8k/train.parquet --val-data data/gsm8k/test.parquet

Each step: n responses per prompt from the engine in every rank or from rollout ranks (the loop takes them
from rollout_source.py, whichever it is) -> rewards (reward.py) -> group-normalized advantages (advantage.py)
-> old and reference log-probs -> the clipped surrogate + KL loss (loss.py) over mini- and micro-batches of
the FSDP2 policy (policy.py) -> the new weights to the engine -> log, validate, checkpoint. The same command
resumes a run exactly (checkpoint.py). Kept from verl's GRPO: its data schema, formulas, defaults and metric
names. With --tools, each response is a conversation: the model's turns and its tools' results
(multi_turn.py), trained on the model's own tokens only. Dropped: a critic (GRPO needs none), KL in
the reward (we use the KL loss, as verl's GRPO examples do), and sequence packing.
"""

import console  # noqa: I001  first, before torch loads: it keeps torch's C++ warnings off the console

import dataclasses
import os
import sys
import time
from functools import partial

import torch

import bands
import checkpoint
import data_prep
import distill
import health
import lora
import report
import reward_model
import rng
import rollout_rank
import rollout_ranks
import rollout_source
import run_dir
import safe_write
import startup
from adamw import MAX_SKIPPED_STEPS, diverged_message, guarded_step, make_optimizer
from advantage import compute_advantages
from cli import parse_args
from config import Args, loggers
from curriculum import Curriculum
from distributed import (
    all_sum,
    all_sum_tensor,
    catch_stop_signals,
    crash_point,
    full_tensor,
    init_distributed,
    print0,
    run,
    stop_requested,
)
from eval import keep_best
from loss import loss_denominator, micro_batch_loss
from memory import check_update_memory
from policy import (
    compute_logprobs,
    load_policy,
    make_batch,
    micro_batch,
    micro_batches,
    reference_logprobs,
    response_logprobs,
    save_hf,
)
from rollout import start_engine
from run_log import RunLog, end_profile, sample_records, should_stop, start_profile, step_metrics, timed
from user_errors import record_root_cause

# ----------------------------------------------------------------------------------------------
# The story: setup, then each step from its prompts to its checkpoint


def main():
    args = parse_args()
    console.quiet(args.verbose)
    split = None  # --rollout-ranks K: the last K ranks only generate (rollout_rank.py)
    if args.rollout_ranks:
        split, rank, world, device = rollout_ranks.init(args.rollout_ranks, args.collective_timeout)
        if split.generates:
            return rollout_rank.run(args, split, rank, world, device)
    else:
        rank, world, device = init_distributed(args.collective_timeout)
    ranks_here = startup.ranks_here()
    mesh, dtype, why = startup.start(args, world, device)
    resume_from, run_lock = run_dir.claim(args, rank)  # noqa: F841 (held until the process exits)
    data_prep.demo_inputs(args, rank)  # the demo makes its own model and data
    startup.check_inputs(args)
    if split:  # the flags as resolved here (the demo's paths, the dtype) to the rollout ranks
        rollout_ranks.send_flags(split, args)
    config = dataclasses.asdict(args)
    print0(f"compute dtype: {args.dtype} ({why})")
    print0(console.config_line(config, dataclasses.asdict(Args()), os.path.join(args.out_dir, "config.json")))
    tokenizer, pad_id, eos_ids, tools = startup.tokenizer_and_tools(args)
    train_rows, val_rows, total_steps = startup.read_data(args, tokenizer, tools)
    if resume_from:  # a finished run ends here, before the engine loads
        with rollout_ranks.stopped_if_exiting(split):
            run_dir.end_if_finished(resume_from, args, total_steps, rank)
    reward_fn = startup.reward_fn(args, train_rows, val_rows, scores=split is None)  # rollout ranks: they score

    # ---------------- the engine first (it sets the process's thread count), then the policy
    engine = None if split else start_engine(args, world, ranks_here, device, dtype)
    kv = getattr(engine, "kv_cache_tokens", None)
    print0(f"rollout engine: {type(engine).__name__ if engine else f'on the {args.rollout_ranks} rollout ranks'}"
           + (f", KV cache of {kv:,} tokens" if kv else ""))  # fmt: skip
    catch_stop_signals()  # after the engine, which may set handlers of its own: SIGTERM/SIGINT now stop politely
    policy, frozen, rm, optimizer, scheduler, lora_args, fingerprint = load_trainer(
        args, mesh, device, dtype, engine, world=world, ranks_here=ranks_here, total_steps=total_steps
    )
    # where each step's rollouts come from: this rank's engine (rollout.collect_rollout), or the rollout ranks
    rollouts = rollout_source.make(split, engine, dtype, args=args, train_rows=train_rows, val_rows=val_rows,
                                   tokenizer=tokenizer, reward=(reward_fn, rm), eos_ids=eos_ids, tools=tools,
                                   pad_id=pad_id, rank=rank, world=world, device=device, total_steps=total_steps)  # fmt: skip

    # ---------------- the run's log, and resume: the newest complete checkpoint, unless told otherwise
    monitor = health.Monitor(bands.parse_bands(args.health_bands), total_steps, config)
    log = RunLog(args.out_dir, config, loggers(args), monitor, rank, args.wandb_project, args.wandb_run_name)
    checkpointer = checkpoint.Checkpointer(args.out_dir, args.max_ckpt_to_keep, args.async_save) if args.save_freq > 0 else None  # fmt: skip
    save = partial(checkpoint.save_run, checkpointer,  # save(step): all a run needs to go on exactly after `step`
                   args=args, train_rows=train_rows, policy=policy, config=config, optimizer=optimizer,
                   scheduler=scheduler, log=log, tokenizer=tokenizer, rollouts=rollouts, fingerprint=fingerprint)  # fmt: skip
    start_step, history = 0, []
    if resume_from:
        start_step, history, saved_rollouts = checkpoint.resume_run(
            resume_from, policy, optimizer, scheduler, args=args, fingerprints=fingerprint
        )
        rollouts.load(saved_rollouts)
    levels = Curriculum(args, train_rows, val_rows, tokenizer, history)  # --curriculum: each task's level, as it was
    rollouts.start(start_step)
    if resume_from:
        rollouts.publish(policy, version=start_step)
        print0(f"resumed from {resume_from} at step {start_step}")
    log.start(config, history, start_step, total_steps)
    if args.val_before_train and args.test_freq > 0 and start_step == 0:
        log.log(0, rollouts.validation(0, log))
        keep_best(log.history, args, policy, tokenizer, rank)

    # ---------------- the loop
    on_policy = args.ppo_epochs == 1 and args.mini_batch_size == args.prompt_batch_size
    optimizer_steps = args.ppo_epochs * (args.prompt_batch_size // args.mini_batch_size)  # per training step
    stop, done, saved, skipped_steps, asked = False, start_step, start_step, 0, stop_requested(device)
    for step in range(start_step + 1, total_steps + 1):
        if asked:  # SIGTERM or SIGINT: the steps done so far are saved after the loop
            break
        timing, t_step, profiler = {}, time.perf_counter(), start_profile(step, args)  # --profile-step
        epoch = (step - 1) // (len(train_rows) // args.prompt_batch_size)
        rng_before = rng.get_state()  # what a checkpoint of step - 1 holds, if this step is abandoned

        # ---- rollout and reward: n responses per prompt from the engine, scored (rollout.collect_rollout)
        ro = rollouts.take(step, timing)
        if asked := abandoned(step, rng_before, device):  # SIGTERM or SIGINT before the update
            break
        samples = [r for r in ro.rows for _ in range(args.group_size)]  # prompt-major, like the rollout

        # ---- advantages, and the batch the update takes
        batch, advantages, mask = training_batch(ro, samples, args, pad_id, device)

        # ---- old and reference log-probs; with --teacher, the teacher's term joins each token's advantage
        old = logprob_passes(
            batch, policy, frozen["reference"], on_policy=on_policy, args=args, device=device, timing=timing
        )
        distilled = {}  # distill/*
        if args.teacher:
            advantages, distilled = distill.teacher_term(
                batch, policy, frozen["teacher"], old, samples=samples, args=args, device=device, timing=timing
            )

        # ---- policy update: ppo_epochs x mini-batches x micro-batches
        with timed(timing, "update_actor"):
            stats, trainer_logp, skipped = update_policy(
                policy, optimizer, batch, step=step, args=args, world=world, device=device
            )
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
        skipped_steps = skipped_steps + 1 if skipped == optimizer_steps else 0

        # ---- the new weights to whoever generates
        with timed(timing, "update_weights"):
            rollouts.publish(policy, version=step)
        timing["step"] = time.perf_counter() - t_step
        end_profile(profiler, step, args, rank)

        # ---- metrics, verl's names, reduced over ranks
        adv_values = advantages[mask.bool()] if advantages.dim() == 2 else advantages  # per token, or per sample
        metrics = step_metrics(ro, step=step, stats=stats, adv_values=adv_values, mask=mask, trainer_logp=trainer_logp,
                               engine_logp=batch["engine_logp"], lr=lr, skipped=skipped, timing=timing, args=args,
                               device=device)  # fmt: skip
        metrics["training/epoch"] = epoch
        metrics.update(ro.remote_metrics | distilled)  # the rollout ranks' times, overlapped; distill/*
        metrics.update(rollouts.metrics(ro))

        # ---- validate, log, keep the best policy
        if args.test_freq > 0 and (step % args.test_freq == 0 or step == total_steps):
            with timed(timing, "testing"):
                metrics.update(rollouts.validation(step, log))
            metrics["timing_s/testing"] = timing["testing"]
        if args.curriculum:  # after a validation, a task at the threshold goes up a level
            metrics.update(levels.step(step, metrics))
        histograms = {"critic/score": ro.scores, "critic/advantages": adv_values.tolist()}
        log.log(step, metrics, histograms | {"response_length": mask.sum(-1).tolist()})
        if any(k.startswith("val-") for k in metrics):
            keep_best(log.history, args, policy, tokenizer, rank)
        first_group = slice(0, args.group_size)  # the first prompt's samples, for the reader
        shown = [t.shown() for t in ro.turns] if ro.turns else ro.texts  # multi-turn: the whole conversation
        log.samples("train.jsonl", step, sample_records(tokenizer, samples[first_group], shown, ro.scores, ro.extras))

        # ---- checkpoint: everything needed to continue this run exactly
        stop = should_stop(log.history, args.early_stop_metric, args.early_stop_patience)
        if skipped_steps == MAX_SKIPPED_STEPS:  # nothing has changed since: the newest checkpoint is from before it
            newest = checkpoint.step_dir(args.out_dir, saved) if saved > start_step else resume_from
            raise SystemExit(diverged_message(args, step - MAX_SKIPPED_STEPS + 1, step, newest, checkpointer))
        done, asked = step, stop_requested(device)
        if checkpointer:
            checkpointer.poll()  # publish a finished background save now, not at the next save
            if step % args.save_freq == 0 or step == total_steps or stop or asked:
                save(step)
                saved = step
        if stop:
            patience = f"{args.early_stop_patience} validations"
            log.write(f"early stop at step {step}: {args.early_stop_metric} has not improved for {patience}")
            break
    if asked and done < total_steps and not stop:  # SIGTERM or SIGINT: keep what was done, exit non-zero
        message = stopped_early(asked, done, saved, total_steps=total_steps, args=args, checkpointer=checkpointer,
                                save=save, log=log, rank=rank)  # fmt: skip
        startup.close(engine, tools, rollouts, early=True)
        record_root_cause(message)
        print0(message)
        sys.exit(128 + asked)  # the shell's convention for "ended by this signal": 143 for SIGTERM
    if checkpointer:
        checkpointer.wait()  # a background save must finish before we exit
    log.close()
    save_final(args, policy, tokenizer, done=done, dtype=dtype, lora_args=lora_args, rank=rank)
    startup.close(engine, tools, rollouts, early=done < total_steps)


# ----------------------------------------------------------------------------------------------
# The story's pieces, in the order main calls them


def load_trainer(args, mesh, device, dtype, engine, *, world, ranks_here, total_steps):
    """The FSDP2 policy (with --kl-coef, the frozen reference; with --lora-rank, adapters), the frozen teacher
    (--teacher, distill.load_teacher), the reward model, the engine put to sleep, the update's memory check,
    AdamW and the learning-rate schedule. Returns (policy, the frozen models {"reference", "teacher"}, reward
    model, optimizer, scheduler, LoRA's args, the fingerprints of LoRA's base and the teacher)."""
    lora_args = (
        (args.lora_rank, args.lora_alpha, args.lora_target_modules, args.lora_dropout) if args.lora_rank else None
    )
    policy, reference = load_policy(
        args.model, mesh, device, dtype, reference=args.kl_coef > 0, lora_args=lora_args,
        offload=args.offload in ("params", "both"), grad_checkpointing=args.grad_checkpointing,
        compiled=args.compile_blocks,
    )  # fmt: skip
    teacher = (
        distill.load_teacher(args, policy, reference, mesh=mesh, device=device, dtype=dtype) if args.teacher else None
    )
    rm = reward_model.load_reward_model(args.reward_model, mesh, device, dtype) if args.reward_model else None
    # what checkpoints hold no copy of, checked on resume: LoRA's frozen base, the teacher
    fingerprint = dict(base_fingerprint=lora.base_fingerprint(policy) if lora_args else None)
    fingerprint["teacher_fingerprint"] = distill.teacher_fingerprint(args, teacher)
    if getattr(engine, "shares_policy", False):  # one rank, the transformers engine: no copy of its own
        engine.share(policy)
    elif engine:
        engine.sleep()
    trained = [p for p in policy.parameters() if p.requires_grad]  # with LoRA, the adapters only
    kv_cache_gib = getattr(engine, "kv_cache_gib", None)  # on CPU the engine keeps its KV cache while training
    check_update_memory(  # after they all loaded
        args, policy, trained, frozen=(reference, teacher), world=world, ranks_here=ranks_here, device=device,
        kv_cache_gib=kv_cache_gib,
    )  # fmt: skip
    optimizer, scheduler = make_optimizer(trained, args, total_steps, device)
    return policy, dict(reference=reference, teacher=teacher), rm, optimizer, scheduler, lora_args, fingerprint


def abandoned(step, rng_before, device):
    """Whether SIGTERM or SIGINT asked to stop during step `step`'s rollout (the signal, or None). The update has
    not started, so the step is abandoned as if it had never begun: the random generators go back to
    `rng_before`, the step's start, which a checkpoint of step - 1 holds."""
    crash_point("rollout", step)  # the kill -9 and SIGTERM tests stop a run here
    if asked := stop_requested(device):
        rng.set_state(rng_before)
    return asked


def training_batch(ro, samples, args, pad_id, device):
    """The step's batch for the update (policy.make_batch), with each token's advantage (group-normalised;
    each prompt's group lives on one rank, REINFORCE++ whitens over all ranks' tokens) and engine log-prob.
    Returns (batch, advantages: [N], or [N, R] for REINFORCE++, the model's tokens [N, R] truncated or not)."""
    group = args.group_size if args.share_prompts else 1  # shared: each prompt runs once per group
    batch = make_batch([r["prompt_ids"] for r in samples], ro.response_ids, pad_id, group, ro.model_mask)
    mask = batch["response_mask"]  # [N, R] the model's tokens (multi-turn: not the tools')
    unscored = ro.extras.get("reward_unscored")  # TRL's functions all returned None: left out (advantage.py)
    advantages = compute_advantages(ro.scores, args.group_size, estimator=args.adv_estimator, response_mask=mask,
                                    norm_by_std=args.norm_adv_by_std, total=partial(all_sum_tensor, device=device),
                                    unscored=unscored)  # fmt: skip
    batch["advantages"] = advantages if advantages.dim() == 2 else advantages[:, None] * mask  # [N, R]
    if args.mask_truncated:  # truncated responses count for nothing in the loss; the metrics still see them
        batch["response_mask"] = mask * ~torch.tensor(ro.truncated)[:, None]
    batch["engine_logp"] = torch.zeros_like(mask)  # [N, R]
    for i, lp in enumerate(ro.logprobs):
        batch["engine_logp"][i, : len(lp)] = torch.tensor(lp)
    return batch, advantages, mask


def logprob_passes(batch, policy, reference, *, args, on_policy, device, timing):
    """Step 5, timed under verl's names: the old log-probs (old_log_prob), recomputed only when the update is not
    exactly on-policy (on-policy the loss uses its own, detached) or a teacher's term needs them, and the frozen
    reference's (ref) with --kl-coef > 0. Sets batch["old_logp"] and batch["ref_logp"]; returns the old ones or None."""
    passes = dict(micro=args.micro_batch_size, max_tokens=args.micro_batch_tokens, temperature=args.temperature)
    with timed(timing, "old_log_prob"):
        old = compute_logprobs(policy, batch, device=device, **passes) if args.teacher or not on_policy else None
        batch["old_logp"] = None if on_policy else old
    with timed(timing, "ref"):
        if args.kl_coef > 0:
            batch["ref_logp"] = reference_logprobs(policy, reference, batch, device=device, **passes)
    return old


def update_policy(policy, optimizer, batch, *, step, args, world, device):
    """ppo_epochs x mini-batches x micro-batches of the loss, one optimizer step per mini-batch; the
    batch carries each token's advantage and old, reference and engine log-probs (policy.PER_TOKEN).
    Returns (stats: each micro-batch's loss terms, grad_norm on each mini-batch's last; the
    trainer's log-probs of the sampled tokens [N, R]; how many optimizer steps were skipped)."""
    mask = batch["response_mask"]  # [N, R]
    mini_local = args.mini_batch_size // world * args.group_size  # sequences per optimizer step on this rank
    stats, trainer_logp, skipped = [], torch.zeros_like(mask), 0
    policy.train()
    for _ in range(args.ppo_epochs):
        for m0 in range(0, mask.shape[0], mini_local):
            rows = list(range(m0, min(m0 + mini_local, mask.shape[0])))
            whole = all_sum(loss_denominator(mask[rows], args), device)  # the mini-batch's tokens, all ranks'
            optimizer.zero_grad(set_to_none=True)
            for mb_rows in micro_batches(batch, rows, args.micro_batch_size, args.micro_batch_tokens):
                mb = micro_batch(batch, mb_rows)  # these rows' tensors, cut to the columns they use
                topk = mb.get("teacher_topk_ids")  # forward_kl_topk: the student's log-probs there, in the same pass
                logp, entropy = response_logprobs(
                    policy, mb, device, args.temperature, entropy_grad=args.entropy_coef > 0, extra_ids=topk
                )  # [b, r] each
                loss, terms, old = micro_batch_loss(logp, entropy, mb, args=args, whole=whole, world=world)
                if args.engine_logprobs:  # for the engine-vs-trainer gap; a device sync, so only when asked
                    trainer_logp[mb_rows, : old.shape[1]] = old.float().cpu()
                loss.backward()  # weighted: the micro-batches' gradients add up to the mini-batch's
                stats.append(terms)
            grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)).item()
            skipped += not guarded_step(optimizer, grad_norm, step=step, offload=args.offload, device=device)
            optimizer.zero_grad(set_to_none=True)
            stats[-1]["grad_norm"] = grad_norm
    return stats, trainer_logp, skipped


def stopped_early(asked, done, saved, *, total_steps, args, checkpointer, save, log, rank):
    """SIGTERM or SIGINT stopped the run after step `done`: keep what was done and say how to go on."""
    if checkpointer and done > saved:
        save(done)
    if checkpointer:
        checkpointer.wait()
        where = f"{checkpoint.step_dir(args.out_dir, done)} holds it" if done else "nothing to save yet"
        message = (
            f"stopped by {asked.name} after step {done} of {total_steps} ({where}): rerun the same command to continue"
        )
    else:
        message = f"stopped by {asked.name} after step {done} of {total_steps}; --save-freq -1 wrote no checkpoint, so a rerun starts over"
    log.close()
    if rank == 0 and done > 0:
        report.write_report(args.out_dir)
    return message


def save_final(args, policy, tokenizer, *, done, dtype, lora_args, rank):
    """The policy (never the reference) in Hugging Face format, then the end-of-run health report."""
    if args.save_model:
        if lora_args:  # first: a final_model of this step says that both are complete
            lora.save_adapter(policy, os.path.join(args.out_dir, "final_adapter"), rank)
            print0(f"saved the LoRA adapter to {os.path.join(args.out_dir, 'final_adapter')}")
        save_hf(
            policy, tokenizer, os.path.join(args.out_dir, "final_model"), rank, step=done, dtype=dtype
        )  # LoRA: merged
        print0(f"saved the policy to {os.path.join(args.out_dir, 'final_model')}")
    if rank == 0:  # last, so nothing is lost if it fails: the health report, from the run directory alone
        path, verdicts = report.write_report(args.out_dir)
        counts = ", ".join(f"{verdicts[k]} {k}" for k in ("problem", "watch", "healthy"))
        print0(f"health report: {path}: {verdicts['overall']} ({counts})")


if __name__ == "__main__":
    run(main, clear_errors=(safe_write.WriteError, safe_write.NonFiniteError))  # they name the path and what to do
