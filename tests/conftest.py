"""Real models and data for the tests, built once per session, offline.

- `gsm8k_data`: the real GSM8K from ../shared/data/gsm8k, converted to verl's parquet schema;
  `gsm8k_head`: its first 64 training and 32 test rows.
- `qwen_model`: the real Qwen2.5 tokenizer, chat template, generation config and 151,936-row
  vocabulary from ../shared/models/qwen2.5-0.5b-instruct, on a random-init Qwen2 with hidden
  size 128 (19.7M parameters, 19.4M of them the tied embedding).
- `smollm2_model`: the real pretrained SmolLM2-135M-Instruct (`python models.py smollm2`).

Tests that need ../shared skip with a message when it is not beside the repository (CI has it).
"""

import json
import os
import subprocess
import sys
import textwrap

# One thread per process: pytest-xdist runs two files at once on two cores, and a run with two OpenMP
# threads beside another busy process runs up to 10x slower. The suite took 30 min 18 s with the
# default thread count and 19 min 33 s with this (2026-11-26, 2 cores). Every run the tests start
# inherits it; set OMP_NUM_THREADS yourself to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.append(os.path.join(REPO, "benchmarks"))  # their shared helpers (common.py), after ours
SHARED = os.path.join(REPO, "..", "shared")
QWEN_DIR = os.path.join(SHARED, "models", "qwen2.5-0.5b-instruct")
GSM8K_DIR = os.path.join(SHARED, "data", "gsm8k")


def pytest_collection_modifyitems(config, items):
    """The files with the most slow tests first, each file's tests in their own order. pytest-xdist hands
    whole files to the two workers (--dist loadfile) in this order (--no-loadscope-reorder; its default
    puts the files with the most tests first, and those are the fast ones), so that the long end-to-end
    files start early instead of running alone at the end."""
    slow = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + bool(item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # a stable sort: a file's tests keep their order


def pytest_terminal_summary(terminalreporter):
    """Name the CPU the suite ran on, beside its time: the time depends on the kind (docs/tests.md)."""
    from common import versions  # benchmarks/common.py: the machine, as every benchmark prints it

    from policy import native_bf16

    info = versions()
    bf16 = "native bf16" if native_bf16(torch.device("cpu")) else "bf16 emulated (no avx512_bf16 or AMX)"
    terminalreporter.write_line(f"CPU: {info['cpu']}, {info['cores']} cores, {bf16}")


def need(path):
    if not os.path.isdir(path):
        pytest.skip(f"{os.path.normpath(path)} is not beside the repository")


@pytest.fixture(scope="session")
def gsm8k_data(tmp_path_factory):
    """Directory with GSM8K's train.parquet and test.parquet in verl's schema."""
    import data_prep

    need(GSM8K_DIR)
    out = tmp_path_factory.mktemp("gsm8k")
    data_prep.main(["gsm8k", "--input", GSM8K_DIR, "--out", str(out)])
    return out


@pytest.fixture(scope="session")
def gsm8k_head(gsm8k_data, tmp_path_factory):
    """gsm8k_data's first 64 training and 32 test rows: for runs that need real GSM8K prompts but not
    all 8,792 of them (every rank of every run renders each prompt with the chat template at start:
    14 s of CPU for all of them with Qwen2.5's tools block)."""
    import pyarrow.parquet as pq

    out = tmp_path_factory.mktemp("gsm8k_head")
    for name, rows in (("train", 64), ("test", 32)):
        pq.write_table(pq.read_table(gsm8k_data / f"{name}.parquet").slice(0, rows), out / f"{name}.parquet")
    return out


def raise_end_of_turn(model_dir, token, boost=1.1):
    """Make a random-init model end its turns: add `boost` to `token`'s row in one embedding column
    that every token has at 1.0. After the final RMSNorm that column is large and positive for any
    input, so `token`'s logit rises by about boost x 11 nats, about 1 in 10 sampled tokens. A random
    model over 151,936 tokens would otherwise never sample it, and no response would end."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight  # [V, H]; tied to the head
        embedding[:, 0] = 1.0
        embedding[token, 0] = 1.0 + boost  # `token` may be a list of ids, each raised alike
    model.save_pretrained(model_dir)


@pytest.fixture(scope="session")
def qwen_model(tmp_path_factory):
    """A random-init Qwen2 with the real Qwen2.5 tokenizer, chat template, generation config (top_k
    20, repetition_penalty 1.1, which must not leak into rollouts) and vocabulary; it ends about
    one token in ten with <|im_end|>."""
    from models import build_random_model

    need(QWEN_DIR)
    out = str(tmp_path_factory.mktemp("qwen") / "qwen2-h128")
    build_random_model(
        out,
        QWEN_DIR,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
    )
    raise_end_of_turn(out, token=151645)  # <|im_end|>
    return out


@pytest.fixture(scope="session")
def qwen_tool_model(tmp_path_factory):
    """qwen_model's like, that also opens and closes tool calls: <|im_end|>, <tool_call> and
    </tool_call> each about one sampled token in ten, so that about a third of its turns call a
    tool (with random tokens for JSON: the model reads an error, and goes on)."""
    from models import build_random_model

    need(QWEN_DIR)
    out = str(tmp_path_factory.mktemp("qwen_tools") / "qwen2-h128")
    sizes = dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)
    build_random_model(out, QWEN_DIR, hidden_size=128, **sizes)
    raise_end_of_turn(out, token=[151645, 151657, 151658])
    return out


@pytest.fixture(scope="session")
def smollm2_model(tmp_path_factory):
    """SmolLM2-135M-Instruct in Hugging Face format (about 30 s to dequantize)."""
    from models import build_smollm2

    return build_smollm2(str(tmp_path_factory.mktemp("smollm2") / "smollm2"))


CHECK_SAVED_MODEL = textwrap.dedent(
    """
    import json, os, sys, torch
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; without it vLLM on CPU reserves most of RAM
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from logprobs import logprobs_from_logits
    path, questions = sys.argv[1], json.loads(sys.argv[2])
    dtype = json.load(open(os.path.join(path, "config.json"))).get("dtype") or "float32"  # both load it as saved
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    assert model.dtype == getattr(torch, dtype), model.dtype
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False) for q in questions]
    llm = LLM(model=path, dtype=dtype, max_model_len=max(map(len, prompts)) + 8, enforce_eager=True, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=4, logprobs=0))
    worst = 0.0
    for p, o in zip(prompts, outs):
        ids = list(o.outputs[0].token_ids)
        logits = model(torch.tensor([p + ids])).logits[:, len(p) - 1 : -1]
        hf = logprobs_from_logits(logits, torch.tensor([ids]))[0]
        assert ids[0] == int(model(torch.tensor([p])).logits[0, -1].argmax()), "greedy tokens differ"
        vl = torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, ids)])
        worst = max(worst, (hf - vl).abs().max().item())
    print("dtype", dtype, "max logprob gap", worst)
    """
)


def check_saved_model(path, questions):
    """Load a saved model in transformers and, in a fresh process, in vLLM; greedy-answer
    `questions` (user messages, rendered with the model's chat template) with vLLM and return the
    largest gap between vLLM's and transformers' log-probs of the answers (the first token is
    checked to be transformers' argmax). Both load it in the dtype its config.json names."""
    proc = subprocess.run(
        [sys.executable, "-c", CHECK_SAVED_MODEL, str(path), json.dumps(questions)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return float(proc.stdout.rsplit("max logprob gap", 1)[1])


def run_script(*flags, ranks=1, script="train_grpo.py"):
    """Run a script under torchrun; returns its stdout, or fails with its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", script, *flags]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def gsm8k_flags(data):
    return ["--train-data", str(data / "train.parquet"), "--val-data", str(data / "test.parquet")]
