"""The trainer's weights into a rollout engine, and the checks that the engine then serves them.

Colocated (every rank its own engine, the default): sync_and_check streams them in, engine.update_weights(
policy.full_parameters(...)): each parameter all-gathered from its FSDP2 shards, one at a time, and loaded in place
by vLLM's own weight loader (vllm_engine.update_weights; no disk, no second copy). With --rollout-ranks, trainer
rank 0 sends them to the rollout ranks (rollout_ranks.py) in buckets of about BUCKET_MB (pack / unpack), each
bucket's float64 sum and sum of squares checked by the receiver. With LoRA both send the merged weights.

After every sync, check_engine compares the engine's log-probs of a fixed probe (the start of a
training prompt) with the trainer's; every step, check_rollout those of the sampled tokens (the probe
is the same prompt on every rank: a TP engine sent different requests by its ranks served it exactly,
and its rollouts 1.4 nats off). A mean gap above PROBE_TOLERANCE means the engine does not serve the
policy (a load that failed quietly, LoRA adapters that never reached it: verl#7495) and raises
WeightSyncError. The same weights differ by about 1e-5 nats in fp32 and 0.05 in bf16 (SmolLM2, vLLM
against transformers), so in bf16 only a gross fault shows.
"""

import math
from contextlib import contextmanager

import torch

from distributed import all_sum
from policy import compute_logprobs, full_parameters, make_batch

BUCKET_MB = 64
PROBE_TOLERANCE = {"fp32": 1e-3, "bf16": 0.25}  # mean |engine - trainer| nats over the probe's tokens
PROBE_TOKENS = 64


class WeightSyncError(RuntimeError):
    pass


def probe_ids(train_rows):
    """The probe: the first PROBE_TOKENS tokens of the first training prompt (at least 2)."""
    ids = list(train_rows[0]["prompt_ids"][:PROBE_TOKENS])
    return ids if len(ids) >= 2 else ids + ids[:1] * (2 - len(ids))


def trainer_probe(policy, ids, pad_id, device):
    """The policy's log-probs of ids[1:], each given the ones before it, at temperature 1 (a collective:
    every trainer rank runs the sharded forward)."""
    batch = make_batch([ids[:1]], [ids[1:]], pad_id)
    return compute_logprobs(policy, batch, micro=1, max_tokens=0, temperature=1.0, device=device)[0].tolist()


def check_engine(engine, ids, expected, *, version, dtype):
    """The mean gap between the engine's log-probs of the probe and the trainer's (`expected`), in nats;
    WeightSyncError above PROBE_TOLERANCE[dtype]."""
    got = engine.prompt_logprobs(ids)
    gap = sum(abs(a - b) for a, b in zip(got, expected)) / len(expected)
    if not gap <= PROBE_TOLERANCE[dtype]:  # NaN fails too
        raise WeightSyncError(
            f"weight sync of policy version {version}: the engine's log-probs of the probe are {gap:.3g} nats from "
            f"the trainer's (mean over {len(expected)} tokens; at most {PROBE_TOLERANCE[dtype]} expected in {dtype}): "
            "the engine is not serving the weights it was sent"
        )
    return gap


def check_rollout(trainer_logp, engine_logp, mask, versions, *, step, args, device):
    """The mean gap, over every rank's tokens, between the engine's log-probs of the step's samples and
    the trainer's ([N, R] each; mask [N, R]), in nats; WeightSyncError above PROBE_TOLERANCE[args.dtype].
    Only the samples of the weights the trainer scored them with (version step - 1: with
    --max-staleness older ones differ by the updates since) and only where the engine's distribution is
    the trainer's: at --top-k / --top-p the engine's log-probs are over the kept tokens, and with
    --lora-dropout the trainer's on-policy ones are under dropout. None: nothing to compare."""
    fresh = [v == step - 1 for v in versions] if versions else [True] * mask.shape[0]
    same = args.engine_logprobs and args.top_k == -1 and args.top_p == 1 and args.lora_dropout == 0
    if not same:
        return None
    tokens = mask.bool() & torch.tensor(fresh, dtype=torch.bool)[:, None]  # [N, R]
    count = int(all_sum(int(tokens.sum()), device))
    if count == 0:
        return None
    gap = all_sum((trainer_logp - engine_logp)[tokens].abs().double().sum().item(), device) / count
    if not gap <= PROBE_TOLERANCE[args.dtype]:  # NaN fails too
        raise WeightSyncError(
            f"step {step}: the engine's log-probs of the sampled tokens are {gap:.3g} nats from the trainer's (mean "
            f"over {count} tokens of all ranks; at most {PROBE_TOLERANCE[args.dtype]} expected in {args.dtype}): the "
            "rollout was not drawn from the policy being trained. With --tensor-parallel-size > 1, the ranks of a group "
            "must send their engine the same requests; else check the weight sync (--verbose shows vLLM's logs)"
        )
    return gap


def sync_and_check(engine, policy, dtype, *, probe, pad_id, device, version, dtype_name):
    """Copy the policy's weights (with LoRA, merged) into the engine one full parameter at a time, under the
    guard that the engine then serves them (engine_serves). Returns the probe's gap."""
    with engine_serves(engine, policy, probe, pad_id, device, version=version, dtype=dtype_name) as checked:
        engine.wake_up()  # once for the copy and the check: on CUDA each wake-up copies the engine's weights back in
        engine.update_weights(full_parameters(policy, dtype))
    engine.sleep()
    return checked["gap"]


@contextmanager
def engine_serves(engine, policy, ids, pad_id, device, *, version, dtype):
    """A weight sync's guard: the trainer's log-probs of the probe `ids` before it (trainer_probe, while the engine
    sleeps and its GPU memory is free), the engine's after it, awake, compared by check_engine (WeightSyncError
    when they differ). Yields a dict whose "gap" it fills."""
    expected, checked = trainer_probe(policy, ids, pad_id, device), {}
    yield checked
    checked["gap"] = check_engine(engine, ids, expected, version=version, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# Buckets: many tensors in few messages


def pack(named_tensors, device="cpu", bucket_mb=BUCKET_MB):
    """(layout: [(name, dtype, shape, bucket, offset)], buckets: flat tensors on `device`, of one dtype each)."""
    layout, buckets, parts, size = [], [], [], 0
    for name, tensor in named_tensors:
        flat = tensor.detach().reshape(-1).to(device)
        if parts and (flat.dtype != parts[0].dtype or size + flat.numel() * flat.element_size() > bucket_mb * 2**20):
            buckets.append(torch.cat(parts))
            parts, size = [], 0
        offset = sum(p.numel() for p in parts)
        layout.append((name, str(flat.dtype).removeprefix("torch."), tuple(tensor.shape), len(buckets), offset))
        parts.append(flat)
        size += flat.numel() * flat.element_size()
    if parts:
        buckets.append(torch.cat(parts))
    return layout, buckets


def bucket_sums(buckets):
    """Each bucket's float64 (sum, sum of squares): what the receiver checks."""
    return [(b.double().sum().item(), b.double().square().sum().item()) for b in buckets]


def unpack(layout, buckets):
    """The (name, tensor) pairs of pack's layout, as views into the buckets."""
    for name, _, shape, bucket, offset in layout:
        yield name, buckets[bucket][offset : offset + math.prod(shape)].view(shape)
