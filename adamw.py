"""AdamW for the policy: the optimizer and its learning-rate schedule (make_optimizer), and each step, guarded.
guarded_step skips an update that must not happen, before it happens: a non-finite gradient norm skips it; so
does an AdamW step that could make a weight non-finite, or move one by orders of magnitude (update_may_overflow:
a bound computed from the optimizer's state, not a trial step), so no such weight is ever written to a
checkpoint or synced to the engine. MAX_SKIPPED_STEPS training steps in a row whose every update was skipped
mean the run has diverged: the trainer stops (diverged_message).
"""

import math
from functools import partial

import torch
import torch.distributed as dist

from distributed import crash_point, print0


def make_optimizer(trained, args, total_steps, device):
    """(AdamW over the `trained` parameters, its schedule: lr_factor at each training step; the trainer steps the
    schedule once per training step, after the step's optimizer steps)."""
    optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=args.weight_decay, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, args=args, total_steps=total_steps))
    return optimizer, scheduler


def lr_factor(step, args, total_steps):
    """The learning rate at `step` as a fraction of --lr: linear warmup, then constant or cosine."""
    if step < args.warmup_steps:
        return (step + 1) / (args.warmup_steps + 1)
    if args.lr_schedule == "cosine":
        progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


MAX_SKIPPED_STEPS = 3  # steps in a row whose every update was skipped: the run has diverged; stop


def guarded_step(optimizer, grad_norm, *, step, offload, device):
    """optimizer.step() after the gradients were clipped to `grad_norm` (their norm before clipping), unless
    grad_norm is not finite or update_may_overflow says why not (then said on rank 0). offload "optimizer":
    AdamW's moments visit `device` for the step only. Returns whether it stepped. A collective."""
    crash_point("update", step)  # the crash tests' kill -9 (or SIGTERM) in the middle of an update
    if not math.isfinite(grad_norm):
        print0(f"step {step}: gradient norm is {grad_norm}; skipping this optimizer step")
        return False
    if why := update_may_overflow(optimizer):  # a non-finite or runaway weight is never written or synced
        print0(f"step {step}: {why}; skipping it")
        return False
    if offload == "optimizer":  # the moments visit the GPU for the step only
        move_optimizer_states(optimizer, device)
        optimizer.step()
        move_optimizer_states(optimizer, "cpu")
    else:
        optimizer.step()
    return True


def move_optimizer_states(optimizer, device):
    """--offload optimizer: AdamW's moments (exp_avg, exp_avg_sq) to `device`, the GPU for the
    optimizer step and the CPU between steps (its step counts stay where they are)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(device)


MAX_GROWTH = 10  # an update that could move a weight by more than this x the largest weight is a divergence
SMALL_WEIGHTS = 0.01  # the largest weight's magnitude counts as at least this (trainable weights that start at 0)


@torch.no_grad()
def update_may_overflow(optimizer):
    """Why optimizer.step() must be skipped, decided before the step, or None: it could make a weight
    non-finite, or move one by more than MAX_GROWTH times the largest trainable weight's magnitude (a
    divergence whose weights are still finite: --lr 1e30 once multiplied every weight by -1e28). For
    torch's AdamW (decoupled weight decay) the update of each weight p with gradient g is

        p' = p (1 - lr wd) - lr / (1 - beta1^t) * m' / (sqrt(v' / (1 - beta2^t)) + eps),
        m' = beta1 m + (1 - beta1) g,   v' = beta2 v + (1 - beta2) g^2.

    |m'| <= max(|m|, |g|) and the denominator is >= eps, so |p'| <= max|p| |1 - lr wd| +
    lr / (1 - beta1^t) * max(|m|, |g|) / eps, with t the smallest step count of the group (the largest
    bound). If that bound is finite every new weight is; it reaches float32's range only for absurd
    learning rates (1e29 at eps 1e-8 and clipped gradients) or weights already near overflow. The
    change |p' - p| is at most lr (wd |p| + min(that step / lr, adam_step_bound)): about 7.3 lr with
    verl's betas (lr at the first step), so the check trips at lr > 1.4 for weights of size 1 and at
    lr > 0.014 for the smallest (SMALL_WEIGHTS), never at the usual 1e-6 to 1e-3. An optimizer
    without betas (SGD, in tests) is bounded as plain gradient descent, lr (wd |p| + |g|). The maxima
    are one foreach kernel per kind of tensor, on the device, and one number comes back to the host:
    one device sync per optimizer step. A collective: every rank gets the same answer."""
    bounds, changes, weights = [], [], []  # 0-d tensors, one per param group, on its gradients' device
    for group in optimizer.param_groups:
        lr, wd = group["lr"], group.get("weight_decay", 0.0)
        beta1, eps = group["betas"][0] if "betas" in group else 0.0, group.get("eps", 1.0)
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        states = [optimizer.state.get(p, {}) for p in params]
        grad = _max_abs([_local(p.grad) for p in params])  # [P], one entry per parameter
        weight = _max_abs([_local(p) for p in params])
        moment = _max_abs([_local(s.get("exp_avg")) for s in states]).to(grad.device)  # CPU with --offload optimizer
        t = _smallest_step(states) + 1
        step = lr / (1 - beta1**t) * torch.maximum(grad, moment) / eps  # [P] lr x the largest |Adam's step|
        bounds.append((weight * abs(1 - lr * wd) + step).max())
        changes.append((weight * lr * wd + step.clamp(max=lr * adam_step_bound(group.get("betas")))).max())
        weights.append(weight.max())
    if bounds:
        maxima = torch.stack([torch.stack(x).max() for x in (bounds, changes, weights)])
    else:  # every rank joins the all_reduce, even with no gradients
        maxima = torch.zeros(3, dtype=torch.float64, device=_local(optimizer.param_groups[0]["params"][0]).device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    bound, change, largest = maxima
    # the one number the host sees: the change over the largest weight, inf if a weight could overflow (or NaN)
    growth = torch.where(bound < torch.finfo(torch.float32).max, change / largest.clamp(min=SMALL_WEIGHTS), math.inf)
    growth, lr = growth.item(), optimizer.param_groups[0]["lr"]
    if not math.isfinite(growth):
        return f"this update could make weights non-finite (lr {lr:.3g})"
    if growth > MAX_GROWTH:
        return f"this update could change weights by up to {growth:.3g}x their largest magnitude (lr {lr:.3g})"
    return None


def adam_step_bound(betas):
    """The largest |m / sqrt(v)| of Adam's bias-corrected moments, whatever the gradients: by
    Cauchy-Schwarz over m = (1 - b1) sum_k b1^k g_k and v = (1 - b2) sum_k b2^k g_k^2 (g_k: the
    gradient k steps ago) it is
    (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2)), 7.27 for betas (0.9, 0.999), and 1 at the first step
    (the bias corrections only lower it before the sum converges). Unbounded (inf) for SGD (no betas)
    and for b1^2 >= b2, where a long run of growing gradients can make it as large as eps allows."""
    if betas is None or betas[0] ** 2 >= betas[1]:
        return math.inf
    b1, b2 = betas
    return (1 - b1) / math.sqrt((1 - b2) * (1 - b1**2 / b2))


def diverged_message(args, first, last, newest, checkpointer):
    """What stops a run whose every update was skipped from step `first` to `last`. A skipped update
    changes nothing, so `newest`, the checkpoint saved (or resumed from) last, holds the weights from
    before the divergence. Waits for its background save, if any (a collective, as the stop is)."""
    if checkpointer:
        checkpointer.wait()
    if newest is None:
        go_on = "rerun with --allow-changed lr: with no checkpoint saved, that starts the run over"
    elif args.resume == "auto":
        go_on = f"rerun with --allow-changed lr: it resumes from {newest}"
    else:
        go_on = f"rerun with --allow-changed lr --resume {newest}"
    return (
        f"steps {first}-{last}: every update was skipped (a non-finite gradient, or an update that could make "
        "weights non-finite or change them by orders of magnitude): training has diverged, and nothing of it was "
        f"saved. Lower --lr (now {args.lr:g}) and {go_on}. If the metrics before step {first} already show the "
        "divergence, start over instead, with a new --out-dir."
    )


def _local(x):
    """A DTensor's shard on this rank; a plain tensor (or None) as it is."""
    return x.to_local() if hasattr(x, "to_local") else x


def _max_abs(tensors):
    """[max |x| for x in tensors] as a float64 vector on their device, 0 for None or an empty shard
    (every non-empty one on one device); NaN propagates. One foreach kernel, no device sync."""
    present = [x.detach() for x in tensors if x is not None and x.numel()]
    device = present[0].device if present else torch.device("cpu")
    norms = iter(torch._foreach_norm(present, ord=float("inf")) if present else [])
    zero = torch.zeros((), device=device)
    return torch.stack([next(norms) if x is not None and x.numel() else zero for x in tensors]).double()


def _smallest_step(states):
    """The smallest of AdamW's step counts in `states` (0 where a state is empty), without a device sync:
    a number where they live on the CPU (foreach AdamW), a 0-d tensor on the GPU for fused AdamW."""
    steps = [s["step"] for s in states if "step" in s]
    if len(steps) < len(states):
        return 0
    if torch.is_tensor(steps[0]) and steps[0].device.type != "cpu":
        return torch.stack(steps).min().double()
    return min(float(s) for s in steps)
