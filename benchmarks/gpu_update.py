"""The update on one GPU, stage by stage, and the CUDA paths that had never run; the JSON (--json) is
rewritten after every stage, so a run cut off by a time limit keeps what finished.

    python benchmarks/gpu_update.py --like DIR --gsm8k DIR --json gpu_update.json    # H100: about 5 min
    python benchmarks/gpu_update.py --dry-run --like ../shared/models/qwen2.5-0.5b-instruct --gsm8k data/gsm8k

1 matmul: the card's bf16 rate (8192^3, and the MLP's shape at the update's tokens). 2 head: the fused
head alone, its GPU blocks (logprobs.head_blocks) against the older ones and others: ms, TFLOP/s, the
largest differences from the materialised logits'. 3 update: train_grpo.update_policy on Qwen2.5-0.5B's
shape (random weights; 16 prompts x 8 x 128 tokens; FSDP2, one rank, bf16): forward, backward, clip,
overflow check and optimizer step, synchronised; MFU; peak memory. 4 ablations: each change toggled alone
from what ships (head, overflow, fused, reshard, expandable). 5 profile: one update, new and old, top 40
kernels. 6 paths: train_grpo.py under torchrun with --offload params, --grad-checkpointing, LoRA, and
killed (SIGKILL) mid-update then resumed, against two runs never killed. --dry-run: a tiny model on the
CPU through the same stages (the suite runs it).
"""

import argparse
import functools
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import common  # noqa: E402
import torch  # noqa: E402

import adamw  # noqa: E402
import logprobs  # noqa: E402
import policy  # noqa: E402
import train_grpo  # noqa: E402
from cli import parse_args as trainer_args  # noqa: E402
from distributed import init_distributed  # noqa: E402

CHANGES = ("head", "overflow", "fused", "reshard", "expandable")  # reshard: keep the gathered weights (one rank)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", required=True, help="a Qwen2.5 config and tokenizer directory (no weights needed)")
    p.add_argument("--gsm8k", required=True, help="train.parquet and test.parquet (python data_prep.py gsm8k)")
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "gpu_update"))
    p.add_argument("--json", default="", help="write every figure here, after each stage")
    p.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU: checks the script, not the speed")
    p.add_argument("--skip", default="", help="comma-separated stages to skip: " + ",".join(STAGES))
    p.add_argument("--budget", type=float, default=420, help="seconds; a stage that starts later is skipped")
    return p.parse_args(argv)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps, warmup=1):
    """(median seconds of fn() over `reps` runs after `warmup`, the last result)."""
    times, out = [], None
    for i in range(warmup + reps):
        sync(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times), out


# ----------------------------------------------------------------------------------------------
# The code before: what each change replaced, for the ablations


def old_head_blocks(n, V, device, dtype=None):
    return (512, 512) if device.type == "cpu" else (max(1, 2**24 // V), V)


def old_add_product(out, a, b):
    if out.dtype == a.dtype == b.dtype:
        out.addmm_(a, b)
    else:
        out += (a.to(b.dtype) @ b).float()


@torch.no_grad()
def old_update_may_overflow(optimizer):
    """adamw.update_may_overflow as it was: a device-to-host copy for every weight, gradient and moment."""
    zero = bound = torch.zeros((), dtype=torch.float64)
    for group in optimizer.param_groups:
        lr, wd = group["lr"], group.get("weight_decay", 0.0)
        beta1, eps = group["betas"][0] if "betas" in group else 0.0, group.get("eps", 1.0)
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state.get(p, {})
            t = float(state.get("step", 0)) + 1
            local = [x.to_local() if hasattr(x, "to_local") else x for x in (p, p.grad, state.get("exp_avg"))]
            big = [x.detach().abs().max().double().cpu() if x is not None and x.numel() else zero for x in local]
            bound = torch.maximum(
                bound, big[0] * abs(1 - lr * wd) + lr / (1 - beta1**t) * torch.maximum(*big[1:]) / eps
            )
    return not bool(bound.item() < torch.finfo(torch.float32).max)


class Setting:
    """Which of CHANGES are on, applied to the modules, the policy and the allocator in place."""

    def __init__(self, model, device, on):
        self.on = set(on)
        logprobs.head_blocks = NEW["head_blocks"] if "head" in self.on else old_head_blocks
        logprobs._add_product = NEW["add_product"] if "head" in self.on else old_add_product
        adamw.update_may_overflow = NEW["overflow"] if "overflow" in self.on else old_update_may_overflow
        for module in model.modules():
            if module is not model and hasattr(module, "set_reshard_after_forward"):
                module.set_reshard_after_forward("reshard" not in self.on, recurse=False)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # new segments only: the setting applies to segments made from now on
            torch.cuda.memory._set_allocator_settings(f"expandable_segments:{'expandable' in self.on}")
        self.fused = "fused" in self.on and device.type == "cuda"


NEW = dict(head_blocks=logprobs.head_blocks, add_product=logprobs._add_product, overflow=adamw.update_may_overflow)


# ----------------------------------------------------------------------------------------------
# Stages 1-2: the matmul rate, the head alone


def matmul_stage(device, dt, shapes):
    out = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dt, device=device), torch.randn(k, n, dtype=dt, device=device)
        s, _ = timed(lambda: a @ b, device, reps=10 if device.type == "cuda" else 3, warmup=2)  # noqa: B023
        out["x".join(map(str, (m, k, n)))] = 2 * m * k * n / s / 1e12
    return out


def head_case(n, H, V, dt, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, H, device=device, dtype=torch.float32, generator=g).to(dt)
    weight = (torch.randn(V, H, device=device, dtype=torch.float32, generator=g) * 0.02).to(dt)
    labels = torch.randint(0, V, (n,), device=device, generator=g)
    grads = torch.randn(2, n, device=device, generator=g)
    return hidden, weight, labels, grads


def run_head(case, rows, cols, add):
    hidden, weight, labels, grads = case
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    logprobs._add_product = add
    logp, ent = logprobs.head_logprobs_entropy(h[None], w, labels[None], 1.0, rows=rows, cols=cols)
    ((logp[0] * grads[0]).sum() + (ent[0] * grads[1]).sum()).backward()
    return logp[0].detach(), ent[0].detach(), h.grad, w.grad


def head_stage(device, dt, n_time, n_check, H, V):
    """Each geometry: forward + backward time on n_time tokens, and on n_check tokens its largest
    differences from the materialised fp32 logits of the same bf16 matmul."""
    gpu = torch.device("cuda")  # the GPU geometries, on the CPU too in a dry run
    new_rows, new_cols = NEW["head_blocks"](n_time, V, gpu)
    geometries = {
        "old: 2^24/V tokens x V, cast then add": (old_head_blocks(n_time, V, gpu), old_add_product),
        f"new: {new_rows} x {new_cols}, addmm into fp32": ((new_rows, new_cols), NEW["add_product"]),
    }
    for rows, cols in ((new_rows, 2048), (new_rows, 8192), (max(1, new_rows // 4), 4 * new_cols)):
        geometries[f"{rows} x {min(cols, V)}, addmm into fp32"] = ((rows, min(cols, V)), NEW["add_product"])
    check = head_case(n_check, H, V, dt, device, seed=1)
    hidden, weight, labels, grads = check
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    z = (h @ w.T).float()  # the bf16 logits, then fp32: what the fused head computes block by block
    logp_ref = torch.log_softmax(z, -1).gather(-1, labels[:, None])[:, 0]
    ent_ref = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    ((logp_ref * grads[0]).sum() + (ent_ref * grads[1]).sum()).backward()
    ref = [logp_ref.detach(), ent_ref.detach(), h.grad, w.grad]
    case, flops, out = head_case(n_time, H, V, dt, device), 8 * n_time * H * V, {}
    for name, ((rows, cols), add) in geometries.items():
        try:
            got = run_head(check, rows, cols, add)
            diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(got, ref)]
            scale = [b.float().abs().max().item() for b in ref[2:]]
            torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
            reps = 5 if device.type == "cuda" else 1
            s, _ = timed(lambda r=rows, c=cols, f=add: run_head(case, r, c, f), device, reps=reps)
            out[name] = dict(
                rows=rows, cols=cols, ms=1e3 * s, tflops=flops / s / 1e12, peak_gib=peak_gib(device),
                max_diff=dict(logp=diffs[0], entropy=diffs[1], grad_hidden=diffs[2], grad_weight=diffs[3]),
                grad_scale=dict(grad_hidden=scale[0], grad_weight=scale[1]),
            )  # fmt: skip
        except Exception as e:  # a geometry that fails is reported, the others still run
            out[name] = dict(error=f"{type(e).__name__}: {e}"[:500])
        print(f"  head {name}: {out[name]}", flush=True)
    logprobs._add_product = NEW["add_product"]
    return dict(tokens=n_time, check_tokens=n_check, hidden=H, vocab=V, flops=flops, geometries=out)


def peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


# ----------------------------------------------------------------------------------------------
# Stages 3-5: the update, its ablations, its profile


def update_setup(args, device):
    """The policy (Qwen2.5's config with random weights, FSDP2 on one rank, bf16), its trainer flags and a
    batch: GSM8K-long prompts (70-140 tokens), 128-token answers, random advantages."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.like)
    P, n, L = (2, 2, 16) if args.dry_run else (16, 8, 128)
    if args.dry_run:
        config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1))
        config.update(dict(num_key_value_heads=1, vocab_size=4096))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mesh = init_device_mesh(device.type, (1,))
    model = policy.shard(model, mesh, torch.bfloat16)
    flags = f"--model {args.like} --prompt-batch-size {P} --mini-batch-size {P} --group-size {n} --micro-batch-size"
    flags += f" {P * n} --micro-batch-tokens 32768 --max-response-length {L} --kl-coef 0 --entropy-coef 0 --lr 1e-6"
    targs = trainer_args(flags.split())
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(70, 141, (P,), generator=g).tolist()
    groups = [torch.randint(0, config.vocab_size, (k,), generator=g).tolist() for k in lens]
    prompts = [p for p in groups for _ in range(n)]
    responses = [torch.randint(0, config.vocab_size, (L,), generator=g).tolist() for _ in range(P * n)]
    batch = policy.make_batch(prompts, responses, pad_id=0, group=n)
    batch["advantages"] = torch.randn(P * n, generator=g)[:, None] * batch["response_mask"]
    batch["engine_logp"], batch["old_logp"] = torch.zeros_like(batch["response_mask"]), None
    body = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name)
    tokens = sum(lens) + P * n * L  # each prompt once per group, and every answer
    flops = 6 * (body * tokens + config.vocab_size * config.hidden_size * P * n * L)
    return model, targs, batch, dict(prompts=P, group=n, length=L, tokens=tokens, flops=flops, params=body)


def optimizer_for(model, setting, lr):
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01, fused=setting.fused)


def update(model, opt, batch, targs, device):
    return train_grpo.update_policy(model, opt, batch, step=1, args=targs, world=1, device=device)


def phases(model, opt, batch, targs, device, reps):
    """update_policy's pieces for one mini-batch of one micro-batch, each timed with synchronisation."""
    from loss import loss_denominator, micro_batch_loss

    out = {k: [] for k in ("forward", "backward", "clip", "overflow", "step")}
    rows = list(range(batch["response_mask"].shape[0]))
    whole = loss_denominator(batch["response_mask"], targs)
    for i in range(reps + 1):
        marks = [time.perf_counter()]
        opt.zero_grad(set_to_none=True)
        for mb_rows in policy.micro_batches(batch, rows, targs.micro_batch_size, targs.micro_batch_tokens):
            mb = policy.micro_batch(batch, mb_rows)
            logp, ent = policy.response_logprobs(model, mb, device, targs.temperature)
            loss, _, _ = micro_batch_loss(logp, ent, mb, args=targs, whole=whole, world=1)
            sync(device), marks.append(time.perf_counter())
            loss.backward()
            sync(device), marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(model.parameters(), targs.grad_clip).full_tensor().item()
        sync(device), marks.append(time.perf_counter())
        adamw.update_may_overflow(opt)
        sync(device), marks.append(time.perf_counter())
        opt.step()
        sync(device), marks.append(time.perf_counter())
        if i:  # the first is a warm-up
            for key, a, b in zip(out, marks, marks[1:]):
                out[key].append(b - a)
    return {k: statistics.median(v) for k, v in out.items()}


def measure(model, targs, batch, device, on, reps, with_phases=False):
    try:
        return measured(model, targs, batch, device, on, reps, with_phases)
    except Exception as e:  # reported; the other settings still run
        return dict(on=sorted(on), error=f"{type(e).__name__}: {e}"[:500])


def measured(model, targs, batch, device, on, reps, with_phases):
    setting = Setting(model, device, on)
    opt = optimizer_for(model, setting, targs.lr)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    s, _ = timed(lambda: update(model, opt, batch, targs, device), device, reps=reps, warmup=2)
    result = dict(on=sorted(setting.on), update_s=s, peak_gib=peak_gib(device))
    if device.type == "cuda":
        result["reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    if with_phases:
        result["phases_s"] = phases(model, opt, batch, targs, device, reps)
    return result


def profile(model, targs, batch, device, on, top=40):
    from torch.profiler import ProfilerActivity, profile

    setting = Setting(model, device, on)
    opt = optimizer_for(model, setting, targs.lr)
    update(model, opt, batch, targs, device)  # the optimizer's state exists: a step like every later one
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        update(model, opt, batch, targs, device)
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kernels = [
        e for e in prof.key_averages() if device.type == "cpu" or e.device_type == torch.autograd.DeviceType.CUDA
    ]
    events = sorted(kernels, key=lambda e: getattr(e, key, 0), reverse=True)
    total = sum(getattr(e, key, 0) for e in events)
    rows = [dict(name=e.key[:160], calls=e.count, ms=getattr(e, key) / 1e3) for e in events[:top]]
    return dict(on=sorted(setting.on), total_ms=total / 1e3, top=rows)


# ----------------------------------------------------------------------------------------------
# Stage 6: the CUDA paths, train_grpo.py under torchrun


def paths_stage(args, device):
    """Each run a few steps of 4 prompts x 4 answers x 32 tokens; the first five at once (one GPU holds
    them), then the killed run's rerun. Exactness: the killed-and-resumed run's metrics.jsonl against the
    uninterrupted runs' (and those two against each other: CUDA's atomic adds may differ run to run)."""
    import gpu
    import same_metrics

    tiny = args.dry_run  # 2 prompts x 2 answers x 16 tokens, one run at a time (two cores), one step fewer
    # fp32 in a dry run: a CPU without bf16 emulates it, 14x slower on Qwen's 151,936-row head (80 s a step)
    small = argparse.Namespace(
        like=args.like, gsm8k=args.gsm8k, work_dir=args.work_dir, prompts=2 if tiny else 4, group_size=2 if tiny else 4,
        response_length=16 if tiny else 32, dtype="fp32" if tiny else "bf16", micro_batch_tokens=32768,
        hidden=64 if tiny else None, layers=2 if tiny else None,
    )  # fmt: skip
    model_dir, quiet, last = gpu.build_model(small), ["--test-freq=-1", "--no-save-model"], 3 if tiny else 4
    runs = {
        "grad-ckpt": (last - 1, ["--grad-checkpointing", "--save-freq=-1", *quiet], None),
        "lora": (last - 1, ["--lora-rank=16", "--lr=1e-4", "--save-freq=-1", *quiet], None),
        "whole-a": (last, ["--save-freq=-1", *quiet], None),
        "whole-b": (last, ["--save-freq=-1", *quiet], None),
        "killed": (last, ["--save-freq=1", "--max-ckpt-to-keep=1", *quiet], f"update:{last - 1}"),  # 6 GB each
    }
    if not tiny:  # --offload params is refused without a GPU
        runs["offload-params"] = (3, ["--offload=params", "--save-freq=-1", *quiet], None)
    else:  # CPU runs repeat exactly: one uninterrupted run will do; the suite covers the rest on the CPU
        runs = {k: runs[k] for k in ("whole-a", "killed")}
    # a dry run's one OpenMP thread: beside the test suite's other worker, two threads stall at every barrier
    how = dict(threads=1 if tiny else None)
    with ThreadPoolExecutor(1 if tiny else len(runs)) as pool:
        futures = {
            k: pool.submit(gpu.run_ours, small, model_dir, k, s, f, crash_at=crash, **how)
            for k, (s, f, crash) in runs.items()
        }
        done = {k: f.result() for k, f in futures.items()}
    out_dir = os.path.join(args.work_dir, "runs", "killed", "out")
    done["resumed"] = gpu.run_ours(small, model_dir, "resumed", last, runs["killed"][1], out_dir=out_dir, **how)
    result = {}
    for k, run in done.items():
        last = run["metrics"][-1] if run["metrics"] else {}
        gap = [m.get("training/rollout_logprob_diff_max") for m in run["metrics"]]
        result[k] = dict(ok=run["ok"], error=run["error"], steps=[m["step"] for m in run["metrics"]],
                         peak_gib=last.get("perf/max_memory_allocated_gb"), engine_gap_max=gap, wall_s=run["wall_s"])  # fmt: skip
    result["killed"]["ok"] = not done["killed"]["ok"]  # it must die: SIGKILL in its last step but one
    log = open(done["resumed"]["log"], errors="replace").read()
    result["resumed"]["resumed_from_checkpoint"] = "resumed from" in log
    a = same_metrics.records(os.path.join(args.work_dir, "runs", "whole-a", "out"))
    for name, where in (("whole-b", "whole-b"), ("resumed", "killed")):
        if name in done:
            result[f"{name} vs whole-a"] = compared(
                a, same_metrics.records(os.path.join(args.work_dir, "runs", where, "out"))
            )
    return result


def compared(a, b):
    """How two runs' metrics.jsonl differ (same_metrics): how many values, and the largest relative gap."""
    import same_metrics

    diff = same_metrics.differences(a, b)
    floats = [(x, y) for _, _, x, y in diff if isinstance(x, float) and isinstance(y, float)]
    gap = max((abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in floats), default=0.0)
    return dict(values=sum(map(len, a)), differ=len(diff), max_rel_diff=gap, first=[list(d) for d in diff[:8]])


# ----------------------------------------------------------------------------------------------


STAGES = ("matmul", "head", "update", "ablations", "profile", "paths")


def main():
    args = parse_args()
    skip = {s for s in args.skip.split(",") if s}
    start = time.perf_counter()
    os.makedirs(args.work_dir, exist_ok=True)
    _, _, gpu = init_distributed()  # a process group of one, for FSDP2
    device = torch.device("cpu") if args.dry_run else gpu
    cuda = device.type == "cuda"
    import transformers

    info = dict(device=torch.cuda.get_device_name() if cuda else "cpu (a dry run)", torch=torch.__version__,
                transformers=transformers.__version__, cpus=os.cpu_count())  # fmt: skip
    results = dict(info=info, config=vars(args), stages={}, seconds={})
    print(json.dumps(info), flush=True)

    save = functools.partial(common.save_stage, results, start=start, json_path=args.json)  # save(stage, value)

    def wanted(stage):
        late = time.perf_counter() - start > args.budget
        if late and stage not in skip:
            results.setdefault("skipped_for_time", []).append(stage)
        return stage not in skip and not late

    dt = torch.bfloat16
    tiny = args.dry_run
    if wanted("matmul"):
        mlp = (256, 64, 128) if tiny else (16384 + 2000, 896, 4864)
        save("matmul", matmul_stage(device, dt, [(512, 512, 512) if tiny else (8192, 8192, 8192), mlp]))
    if wanted("head"):
        save(
            "head",
            head_stage(
                device, dt, 256 if tiny else 16384, 64 if tiny else 4096, 64 if tiny else 896, 4096 if tiny else 151936
            ),
        )
    if {"update", "ablations", "profile"} - skip:
        update_stages(args, device, results, save, wanted)
    torch.distributed.destroy_process_group()
    if wanted("paths"):
        save("paths", paths_stage(args, device))
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)


def update_stages(args, device, results, save, wanted):
    model, targs, batch, work = update_setup(args, device)
    reps = 1 if args.dry_run else 5
    shipped = set(CHANGES) - ({"reshard"} if device.type == "cuda" else set())  # what policy.shard does
    rate = max(results["stages"].get("matmul", {"": float("nan")}).values())
    if wanted("update"):
        rows = {}
        for name, on in (("new", shipped), ("old", ())):
            rows[name] = measure(model, targs, batch, device, on, reps, with_phases=True)
            if "update_s" in rows[name]:
                rows[name]["tflops"] = work["flops"] / rows[name]["update_s"] / 1e12
                rows[name]["mfu"] = rows[name]["tflops"] / rate
            print(f"  update {name}: {rows[name]}", flush=True)
        save("update", dict(work=work, matmul_tflops=rate, **rows))
    if wanted("ablations"):
        rows = {"all": measure(model, targs, batch, device, shipped, reps)}
        for change in CHANGES:  # each toggled from what ships: the GPU reshards by default (policy.reshard)
            flip = f"{'without' if change in shipped else 'with'} {change}"
            rows[flip] = measure(model, targs, batch, device, set(shipped) ^ {change}, reps)
            print(f"  ablation {flip}: {rows[flip]}", flush=True)
        rows["all, again"] = measure(model, targs, batch, device, shipped, reps)
        print(f"  ablation all: {rows['all']}, again: {rows['all, again']}", flush=True)
        save("ablations", rows)
    if wanted("profile"):
        try:
            save(
                "profile",
                {name: profile(model, targs, batch, device, on) for name, on in (("new", shipped), ("old", ()))},
            )
        except Exception as e:
            save("profile", dict(error=f"{type(e).__name__}: {e}"[:500]))
    Setting(model, device, shipped)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
