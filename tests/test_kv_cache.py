"""rollout.py: the CPU KV cache is sized for the rollout (cpu_kv_cache_bytes), and a rollout that
overflows it keeps per-prompt seeds. Its own module: it starts a vLLM engine of its own, and
test_rollout.py holds one for its whole module."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import vllm_engine
from models import build_tiny_model
from vllm_engine import VLLMEngine

WORDS = [str(d) for d in range(10)] + ["list", "pos"]  # as test_rollout.py: ids up to 18
MAX_LEN = 512


def samples_of(out, i, n):
    return out.response_ids[i * n : (i + 1) * n]


def test_the_kv_cache_is_sized_for_the_rollout_and_seeds_hold_when_it_overflows(tmp_path, monkeypatch):
    # The engine's cache holds `sequences` of max_model_len tokens: 2 x 512 = 1,024 tokens. A rollout
    # of 32 sequences then runs a few at a time, and the long ones outgrow the cache: vLLM preempts
    # them (frees their blocks, recomputes them later). Each prompt's samples must still be those
    # it draws alone. (Temperature 0.3: at 1 the random model ends most answers within ~30 tokens.)
    pytest.importorskip("vllm")
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted = []
    preempt = Scheduler._preempt_request
    monkeypatch.setattr(
        Scheduler, "_preempt_request", lambda self, req, *a, **k: preempted.append(1) or preempt(self, req, *a, **k)
    )
    model_path = build_tiny_model(str(tmp_path / "tiny"), WORDS, seed=0)
    config = AutoModelForCausalLM.from_pretrained(model_path).config
    engine = VLLMEngine(model_path, max_model_len=MAX_LEN, seed=0, sequences=2, memory_gib=64.0)
    try:
        assert engine.kv_cache_tokens == 2 * MAX_LEN
        per_token = vllm_engine.kv_bytes_per_token(config, torch.float32)
        assert engine.kv_cache_gib == pytest.approx(2 * MAX_LEN * per_token / 2**30)
        rng = random.Random(1)
        prompts = [[1] + [rng.randrange(7, 19) for _ in range(rng.randrange(3, 30))] for _ in range(16)]
        seeds, new = list(range(100, 116)), MAX_LEN - 32  # the longest prompt plus its answer fit max_model_len
        out = engine.generate(prompts, n=2, temperature=0.3, max_new_tokens=new, seeds=seeds)
        assert preempted, "no sequence outgrew the cache: the test no longer tests preemption"
        for i in range(len(prompts)):
            alone = engine.generate([prompts[i]], n=2, temperature=0.3, max_new_tokens=new, seeds=[seeds[i]])
            assert samples_of(out, i, 2) == alone.response_ids
    finally:
        engine.close()
