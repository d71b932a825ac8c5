"""The console tells the run's own story, from rank 0: its config, the engine, the progress bar, each validation,
the health warnings and the health report's verdict. Third-party messages that ask nothing of the user are kept
off it unless --verbose: each is named below by where it comes from and how it starts, with why it is safe to
drop. Any other warning, and every error, still shows. vLLM's INFO lines are the engine's to keep off
(vllm_engine.py asks vLLM for warnings and errors only, and drops the rotary warning of every weight sync)."""

import logging
import os
import re
import sys
import textwrap
import warnings
from collections import namedtuple

# torch reads its C++ log level (TORCH_CPP_LOG_LEVEL) once, as it loads: train_grpo.py imports this module before
# torch, so that level is ERROR unless --verbose (or the variable is set already). See the note below PYTHON_WARNINGS.
if "--verbose" not in sys.argv:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

# A message kept off the console: its origin (a logger's or a warning's module), how it starts, why it is safe;
# a Python warning's category
Silenced = namedtuple("Silenced", "origin start why category", defaults=[None])

VLLM_LOGS = [
    Silenced(
        "vllm.triton_utils.importing",
        "Triton is installed, but doesn't include CPU backend",
        "the triton package here is the CUDA one (xgrammar, a vLLM dependency, pulls it in); vLLM's CPU build "
        "runs its own C++ kernels and turns Triton off, as it says",
    ),
    Silenced(
        "vllm.platforms.cpu",
        "Triton is not installed. triton-cpu is expected",
        "no package on PyPI provides triton-cpu; vLLM's CPU build runs without it",
    ),
    Silenced(
        "vllm.platforms.cpu",
        "Reset SSM cache type to float32",
        "logged for every model on CPU; only Mamba-style layers have an SSM cache, and ours have none",
    ),
    Silenced(
        "vllm.engine.arg_utils",
        "The global random seed is set to",
        "we run vLLM in this process on purpose (vllm_engine.py); it seeds the global generators with the run's "
        "seed, which startup.start has set already, and a resumed run restores its random state after the engine "
        "starts (rng.py)",
    ),
    Silenced(
        "vllm.engine.arg_utils",
        "This model does not officially support disabling chunked prefill",
        "we turn chunked prefill off on CPU on purpose (vllm_engine.cpu_scheduling says why); the tests check "
        "vLLM's samples and log-probs against transformers",
    ),
    Silenced(
        "vllm.config.vllm",
        "Enforce eager set",
        "we ask for eager mode on CPU: torch.compile there costs minutes at start-up",
    ),
    Silenced(
        "vllm.config.vllm",
        "Inductor compilation was disabled by user settings",
        "the same choice of eager mode, said a second time",
    ),
    Silenced(
        "vllm.config.vllm",
        "Model Runner V2 requires Triton",
        "without Triton vLLM runs its V1 model runner, the one our tests check",
    ),
    Silenced(
        "vllm.v1.worker.cpu_worker",
        "%s is not found in LD_PRELOAD",
        "a speed hint for serving (tcmalloc, Intel OpenMP); docs/vllm_on_cpu.md says how to follow it",
    ),
    Silenced(
        "vllm.v1.worker.cpu_worker",
        "CPU backend doesn't allow to use `torch.set_num_threads`",
        "vLLM's own start-up calls torch.set_num_threads after its CPU worker made it a no-op; torch keeps the "
        "thread count it had (docs/vllm_on_cpu.md, Threads)",
    ),
]

PYTHON_WARNINGS = [
    Silenced(
        "vllm.triton_utils.dispatcher",
        "`torch.distributed.reduce_op` is deprecated",
        "vLLM reads every attribute of torch.distributed when it looks for kernels, the deprecated alias among "
        "them; nothing uses it",
        FutureWarning,
    ),
    Silenced(
        "torch.distributed.fsdp._fully_shard._fsdp_state",
        "FSDP2-wrapped module (",
        "it warns that an in-place op on a view the model returned would skip an all-gather; the view is the "
        "fused head's placeholder logits (policy.response_logprobs), which nothing reads, and the trainer never "
        "changes a model's outputs in place",
        UserWarning,
    ),
]

# torch's C++ log (c10): importing this module before torch sets its level to ERROR (the top of this file), unless
# --verbose (or the variable is set already). Its one warning in
# our runs is vLLM's CPU worker binding memory to a NUMA node ("NUMA binding: Using MEMBIND policy ..."), which
# vLLM always does there and offers no setting for. A C++ warning raised inside a torch call still becomes a
# Python warning and shows; C++ errors show.


class DropKnown(logging.Filter):
    """Drops a logger's records whose message (its format string) starts with one of `starts`."""

    def __init__(self, starts):
        super().__init__()
        self.starts = tuple(starts)

    def filter(self, record):
        return not (isinstance(record.msg, str) and record.msg.startswith(self.starts))


def quiet(verbose):
    """Unless --verbose: no transformers progress bars (loading, saving), which would break the log's lines,
    and none of the messages above. Call before vLLM or the policy loads: a logger's filter applies from the
    moment it is added, whether or not vLLM has been imported."""
    if verbose:
        return
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    for origin in sorted({s.origin for s in VLLM_LOGS}):
        logging.getLogger(origin).addFilter(DropKnown(s.start for s in VLLM_LOGS if s.origin == origin))
    for s in PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", re.escape(s.start), s.category, re.escape(s.origin) + r"\Z")


def config_line(config, defaults, path, width=120):
    """The run's config as the console shows it: the flags that differ from their defaults, and where the
    whole config is (every checkpoint holds it too)."""
    changed = " ".join(f"{k}={v}" for k, v in config.items() if defaults.get(k) != v)
    rest = f"the other flags have their defaults (all of them: {path})"
    line = f"config: {changed}; {rest}" if changed else f"config: every flag has its default (all of them: {path})"
    return textwrap.fill(line, width, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False)
