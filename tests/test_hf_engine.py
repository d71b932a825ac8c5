"""hf_engine.py's two ways of decoding and its engine on the policy's own weights.

GraphDecoder (a static KV cache, 4D masks, every input updated in place, so that CUDA can replay a captured
step) must compute what CacheDecoder (transformers' DynamicCache) computes; off CUDA its steps run eagerly,
which is what is checked here. The engine that shares a one-rank FSDP2 policy (gathered_model) must sample
exactly what an engine with its own synced copy samples, before and after an update, and free the gathered
weights when it sleeps. tests/test_checkpoint.py runs the trainer both ways and compares every metric.
"""

import os

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from hf_engine import CacheDecoder, GraphDecoder, HFEngine
from models import build_tiny_model
from policy import full_parameters, load_model, shard

WORDS = [str(d) for d in range(10)] + ["list", "pos"]
PROMPTS = [[1, 4, 7, 8, 9, 5], [1, 4, 10, 11, 5], [1, 5]]  # token ids of different lengths: left padding
MAX_LEN = 64


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("hf_engine") / "tiny"), WORDS, seed=0)


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of one rank in this process (FSDP2 needs one), torn down after the module."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@torch.no_grad()
def test_static_cache_steps_give_the_dynamic_caches_logits(model_path):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    B, T0, steps = len(PROMPTS), max(map(len, PROMPTS)), 10
    ids, mask = torch.zeros((B, T0), dtype=torch.long), torch.zeros((B, T0), dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, T0 - len(p) :], mask[i, T0 - len(p) :] = torch.tensor(p), 1
    fed = torch.randint(3, len(WORDS) + 3, (steps, B), generator=torch.Generator().manual_seed(0))  # [steps, B]
    logits = {}
    for cls in (CacheDecoder, GraphDecoder):
        decoder = cls(model, mask.clone(), steps)
        logits[cls] = torch.stack([decoder.prefill(ids)] + [decoder.step(t) for t in fed[:-1]])  # [steps, B, V]
    assert logits[CacheDecoder].isfinite().all()
    torch.testing.assert_close(logits[GraphDecoder], logits[CacheDecoder], atol=1e-5, rtol=0)


def test_the_static_decoder_samples_what_the_eager_loop_samples(model_path):
    """The whole engine, each way: the same tokens, the same log-probs, the same EOS and truncation."""
    outs = []
    for static in (False, True):
        engine = HFEngine(model_path, max_model_len=MAX_LEN, seed=0, max_batch_size=4)
        engine.graphs = static  # GraphDecoder's steps, eagerly off CUDA
        outs.append(engine.generate(PROMPTS, n=3, temperature=1.0, max_new_tokens=12, seeds=[4, 5, 6]))
    assert outs[0].response_ids == outs[1].response_ids and outs[0].truncated == outs[1].truncated
    assert any(outs[0].truncated) and not all(outs[0].truncated)  # both endings occur
    torch.testing.assert_close(sum(outs[1].logprobs, []), sum(outs[0].logprobs, []), atol=1e-5, rtol=0)


def test_the_engine_on_the_policys_weights_samples_what_a_synced_copy_samples(model_path, world_of_one):
    """fp32, one rank: bit for bit, before and after an optimizer step that the copy gets by update_weights and
    the shared engine by nothing at all; sleeping frees the gathered weights."""
    policy = shard(load_model(model_path, torch.float32, torch.device("cpu")), world_of_one)
    shared = HFEngine(model_path, max_model_len=MAX_LEN, seed=0, shares_policy=True)
    shared.share(policy)
    copy = HFEngine(model_path, max_model_len=MAX_LEN, seed=0)
    assert shared.model is None  # no model of its own

    def both():
        shared.wake_up()
        outs = [e.generate(PROMPTS, n=4, temperature=1.0, max_new_tokens=10, seeds=[1, 2, 3]) for e in (shared, copy)]
        gathered = next(shared.model.parameters())
        shared.sleep()
        assert gathered.untyped_storage().size() == 0 and shared.model is None  # freed until the next wake_up
        assert outs[0].response_ids == outs[1].response_ids and outs[0].logprobs == outs[1].logprobs
        return outs[0]

    before = both()
    first = shared.gathered
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    policy(torch.tensor([PROMPTS[0]])).logits.square().mean().backward()
    optimizer.step()
    copy.update_weights(full_parameters(policy, torch.float32))
    assert both().logprobs != before.logprobs  # the update reached both engines
    assert shared.gathered is first  # built once: FSDP2 gathers into the same tensors each time
    with pytest.raises(RuntimeError, match="nothing to copy"):
        shared.update_weights([])


def test_a_policy_the_engine_cannot_share_is_an_error_naming_the_way_out(model_path, monkeypatch):
    import hf_engine

    def fails(policy, before):
        raise ValueError("gathered_model: SomeForCausalLM has tensors the policy lacks: ['x.weight']")

    monkeypatch.setattr(hf_engine, "gathered_model", fails)
    engine = HFEngine(model_path, max_model_len=MAX_LEN, shares_policy=True)
    engine.share(object())
    with pytest.raises(RuntimeError, match="tensors the policy lacks.*--no-engine-shares-policy gives it a copy"):
        engine.wake_up()
