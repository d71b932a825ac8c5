"""One GRPO step of the demo, in one process, printed as it happens: read this file first.

    python one_step.py                  # under a minute on 2 CPU cores; any train_grpo.py flag works here too

It runs the steps train_grpo.py runs for step 1 on one rank with --rollout hf, in the same order and through
the same functions, and prints each quantity as it is made, naming the file:function whose math it shows.
It holds no formula of its own: tests/test_one_step.py checks that its samples, rewards, advantages, loss
terms, gradient norms and new weights are the trainer's, exactly. Left out, and where to find them: FSDP2
(policy.shard), vLLM (vllm_engine.py), copying weights into a separate engine (weight_sync.py), logging,
validation and checkpoints (train_grpo.py). Two flags differ from the demo's, so that there is something to
see: --kl-coef 0.001 (a frozen reference model and a KL term) and --mini-batch-size 32 (two optimizer steps:
the second mini-batch is scored by a policy that has moved, so its ratios are not 1).
"""

import console  # noqa: I001  first, before torch loads: it keeps torch's C++ warnings off the console

import random
import sys

import numpy as np
import torch

import data_prep
import startup
from adamw import guarded_step, make_optimizer
from advantage import compute_advantages, group_stats
from cli import parse_args
from distributed import init_distributed
from loss import clipped_surrogate, kl_penalty, loss_denominator, micro_batch_loss
from policy import compute_logprobs, load_model, make_batch, micro_batch, micro_batches, response_logprobs
from rollout import collect_rollout, start_engine

TOUR_FLAGS = ["--rollout", "hf", "--kl-coef", "0.001", "--mini-batch-size", "32", "--out-dir", "runs/one_step"]


def show(where, what):
    """A block's heading: what it shows, and the file:function whose math it is."""
    print(f"\n== {what}  [{where}]")


def main(argv=None):
    args = parse_args(TOUR_FLAGS + list(sys.argv[1:] if argv is None else argv))  # the demo's flags, as train_grpo
    console.quiet(args.verbose)
    rank, world, device = init_distributed()  # a world of one process, no torchrun
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)  # as startup.start seeds
    data_prep.demo_inputs(args, rank)  # the tiny model (2 layers, a 20-word vocabulary) and the digits task
    tokenizer, pad_id, eos_ids, tools = startup.tokenizer_and_tools(args)
    train_rows, val_rows, total_steps = startup.read_data(args, tokenizer, tools)
    reward_fn = startup.reward_fn(args, train_rows, val_rows)  # the digits task's built-in reward
    engine = start_engine(args, world, 1, device, torch.float32)  # transformers' sampling loop, in this process
    policy = load_model(args.model, torch.float32, device)  # what we train; the engine samples from it (share)
    reference = load_model(args.model, torch.float32, device).eval().requires_grad_(False) if args.kl_coef > 0 else None
    engine.share(policy)
    optimizer, scheduler = make_optimizer(list(policy.parameters()), args, total_steps, device)
    n, step = args.group_size, 1
    record = {}  # what tests/test_one_step.py compares with the trainer's

    # ---- 1. rollout: n samples per prompt, each scored by the reward function
    ro = collect_rollout(engine, train_rows, step, args=args, rank=rank, world=world, tokenizer=tokenizer,
                         reward=(reward_fn, None), eos_ids=eos_ids, timing={}, device=device)  # fmt: skip
    show("rollout.py:step_prompts", f"the step's prompts: {len(ro.rows)} of {len(train_rows)}, shuffled by the seed")
    for r in ro.rows[:3]:
        print(f"  {tokenizer.decode(r['prompt_ids'])!r}   answer: {r['reward_model']['ground_truth']}")
    show("rollout.py:collect_rollout -> engine.generate, reward.py:score_one", f"prompt 0's {n} samples, rewards")
    for text, score in zip(ro.texts[:n], ro.scores[:n]):
        print(f"  {text!r:28} reward {score:g}")
    record.update(response_ids=ro.response_ids, scores=ro.scores)

    # ---- 2. advantages: each sample's reward against its group's
    groups = torch.tensor(ro.scores).view(-1, n)  # [B, n]
    mean, std = group_stats(groups)
    prompts = [r["prompt_ids"] for r in ro.rows for _ in range(n)]  # [N = B * n], prompt-major like the rollout
    batch = make_batch(prompts, ro.response_ids, pad_id, n if args.share_prompts else 1)
    mask = batch["response_mask"]  # [N, R]: 1 on the tokens the model wrote
    advantages = compute_advantages(
        ro.scores, n, estimator=args.adv_estimator, norm_by_std=args.norm_adv_by_std, response_mask=mask
    )  # [N]
    batch["advantages"] = advantages[:, None] * mask  # [N, R]: each response's advantage on each of its tokens
    show("advantage.py:grpo_advantages", "A_i = (r_i - mean(r)) / (std(r) + 1e-6) within each group")
    differ = [g for g in range(len(groups)) if std[g, 0] > 0]
    for g in differ[:2] + [g for g in range(len(groups)) if g not in differ][:1]:  # two that differ, one that does not
        a = [round(x, 3) for x in advantages[g * n : g * n + n].tolist()]
        print(f"  group {g}: rewards {groups[g].tolist()}\n    mean {mean[g, 0]:.4f}  std {std[g, 0]:.4f}  A = {a}")
    equal = (groups.amax(1) == groups.amin(1)).float().mean()
    print(f"  {equal:.0%} of the groups have rewards all equal: their A are exactly 0, nothing to learn from them")
    record["advantages"] = advantages

    # ---- 3. old and reference log-probs of the sampled tokens, before the update
    passes = dict(micro=args.micro_batch_size, max_tokens=args.micro_batch_tokens, temperature=args.temperature)
    on_policy = args.ppo_epochs == 1 and args.mini_batch_size == args.prompt_batch_size
    batch["old_logp"] = None if on_policy else compute_logprobs(policy, batch, device=device, **passes)
    batch["ref_logp"] = compute_logprobs(reference, batch, device=device, **passes) if reference else None  # frozen
    show("policy.py:make_batch, policy.py:response_logprobs", "the batch: prompts left-padded, responses right-padded")
    print(
        f"  input_ids {list(batch['input_ids'].shape)} = [samples, prompt width {batch['prompt_width']} + "
        f"response width {mask.shape[1]}];  response_mask, advantages, old_logp, ref_logp {list(mask.shape)}"
    )
    old0 = (
        "none: on-policy, the update's own, detached"
        if on_policy
        else [round(x, 3) for x in batch["old_logp"][0].tolist()]
    )
    print(f"  sample 0: response ids {batch['responses'][0].tolist()}, mask {mask[0].tolist()}, old_logp {old0}")

    # ---- 4. the update: ppo_epochs x mini-batches x micro-batches, one AdamW step per mini-batch
    before = [p.detach().clone() for p in policy.parameters()]
    mini = args.mini_batch_size * n  # sequences per optimizer step
    stats, grad_norms, shown = [], [], False
    policy.train()
    for m0 in range(0, mask.shape[0], mini):
        rows = list(range(m0, min(m0 + mini, mask.shape[0])))
        whole = loss_denominator(mask[rows], args)  # the mini-batch's tokens: each micro-batch weighs its share
        optimizer.zero_grad(set_to_none=True)
        for mb_rows in micro_batches(batch, rows, args.micro_batch_size, args.micro_batch_tokens):
            mb = micro_batch(batch, mb_rows)
            logp, entropy = response_logprobs(policy, mb, device, args.temperature, entropy_grad=args.entropy_coef > 0)
            loss, terms, old = micro_batch_loss(logp, entropy, mb, args=args, whole=whole, world=world)
            loss.backward()
            stats.append(terms)
            last_mini = m0 + mini >= mask.shape[0]  # after the first step its ratios are not 1
            if last_mini and not shown and ((mb["advantages"] != 0).any() or mb_rows[-1] == rows[-1]):
                shown = one_sample(mb, logp.detach(), old, terms, args, m0 // mini)
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip).item()
        after = torch.nn.utils.get_total_norm([p.grad for p in policy.parameters()]).item()
        stepped = guarded_step(optimizer, norm, step=step, offload=args.offload, device=device)
        show("adamw.py:guarded_step", f"mini-batch {m0 // mini}: gradient norm {norm:.4g}, clipped to {after:.4g} "
             f"(--grad-clip {args.grad_clip}); AdamW {'stepped' if stepped else 'skipped'} at lr {scheduler.get_last_lr()[0]:.3g}")  # fmt: skip
        grad_norms.append(norm)
        optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    moved = torch.stack([(p.detach() - b).norm() for p, b in zip(policy.parameters(), before)]).norm()
    largest = max((p.detach() - b).abs().max().item() for p, b in zip(policy.parameters(), before))
    show("torch.optim.AdamW", f"the weights moved by {moved:.4g} in L2 over {sum(b.numel() for b in before):,} "
         f"weights, at most {largest:.3g} for one")  # fmt: skip

    # ---- 5. the new weights to the engine
    show("weight_sync.py:sync_and_check", "the new weights to the engine: nothing to copy here, this engine samples "
         "from the policy's own weights; vLLM gets each parameter streamed in (vllm_engine.update_weights), then a "
         "probe's log-probs are checked against the trainer's")  # fmt: skip
    weights = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    record.update(stats=stats, grad_norms=grad_norms, weights=weights)
    return record


def one_sample(mb, logp, old, terms, args, mini_batch):
    """For the micro-batch's sample of largest |advantage|: each token's ratio, clipped
    surrogate and KL; then the micro-batch's loss terms."""
    i = int(mb["advantages"].abs().amax(-1).argmax())  # the largest |A|
    on = mb["response_mask"][i].bool()
    adv = mb["advantages"][i][on]
    token_loss, per_token = clipped_surrogate(logp[i][on], old[i][on], adv, args.clip_low, args.clip_high, args.clip_c)
    ref = mb["ref_logp"][i][on] if mb.get("ref_logp") is not None else logp[i][on]  # --kl-coef 0: no reference
    kl = kl_penalty(logp[i][on], ref, args.kl_kind)
    show(
        "loss.py:clipped_surrogate, loss.py:kl_penalty",
        f"one sample of mini-batch {mini_batch}, token by token (A = {adv[0]:.3f})",
    )
    print(f"  token  log pi   log pi_old  ratio   clipped   surrogate  KL ({args.kl_kind})")
    for t, tok in enumerate(mb["responses"][i][on].tolist()):
        clipped = "yes" if per_token["pg_clipfrac"][t] else "no"
        print(f"  {tok:5d}  {logp[i][on][t]:7.4f}  {old[i][on][t]:9.4f}  {per_token['ratio'][t]:.4f}  "
              f"{clipped:>7}  {token_loss[t]:10.5f}  {kl[t]:.2e}")  # fmt: skip
    show("loss.py:micro_batch_loss", f"its micro-batch's loss terms, each aggregated by --loss-agg {args.loss_agg}")
    print("  " + "  ".join(f"{k} {v:.4g}" for k, v in terms.items()))
    return True


if __name__ == "__main__":
    main()
