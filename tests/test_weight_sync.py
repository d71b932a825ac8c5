"""weight_sync.py: after a sync the engine's log-probs of a probe must match the trainer's; an engine
that never got the LoRA adapters (verl#7495), or got the unmerged base, is an error naming the version.
The buckets carry every tensor exactly."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import lora
from hf_engine import HFEngine
from models import build_tiny_model
from weight_sync import WeightSyncError, bucket_sums, pack, sync_and_check, unpack

WORDS = [str(d) for d in range(10)] + ["list", "pos"]
PROBE = [3, 5, 7, 2, 9, 4, 11, 6]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), WORDS, seed=0)


def trained_lora_policy(path):
    """A LoRA policy whose adapters have moved, as after some updates: B is no longer zero."""
    torch.manual_seed(0)
    model = lora.add_adapters(AutoModelForCausalLM.from_pretrained(path), 4, 32.0, "all-linear", 0.0)
    with torch.no_grad():
        for layer in lora.lora_layers(model).values():
            layer.lora_B[lora.ADAPTER].weight.normal_(0, 0.05)
    return model


def check(engine, model, version=3):
    return sync_and_check(
        engine, model, torch.float32, probe=PROBE, pad_id=0, device="cpu", version=version, dtype_name="fp32"
    )


def test_the_merged_lora_weights_reach_the_engine(tiny):
    model, engine = trained_lora_policy(tiny), HFEngine(tiny, max_model_len=32)
    assert check(engine, model) < 1e-5
    with torch.no_grad():  # the next update
        next(iter(lora.lora_layers(model).values())).lora_B[lora.ADAPTER].weight.add_(0.05)
    assert check(engine, model, version=4) < 1e-5


def test_an_engine_that_never_got_the_adapters_is_an_error_naming_the_version(tiny, monkeypatch):
    model, engine = trained_lora_policy(tiny), HFEngine(tiny, max_model_len=32)
    monkeypatch.setattr(engine, "update_weights", lambda named: [None for _ in named])  # consumed, never loaded
    with pytest.raises(WeightSyncError, match="weight sync of policy version 3: the engine's log-probs"):
        check(engine, model)


def test_syncing_the_unmerged_base_is_an_error(tiny, monkeypatch):
    model, engine = trained_lora_policy(tiny), HFEngine(tiny, max_model_len=32)
    base = lambda m, dtype: ((lora.hf_name(n), p) for n, p in m.named_parameters() if ".lora_" not in n)  # noqa: E731
    monkeypatch.setattr("weight_sync.full_parameters", base)
    with pytest.raises(WeightSyncError, match="version 7"):
        check(engine, model, version=7)


def test_buckets_carry_every_tensor_exactly():
    torch.manual_seed(0)
    tensors = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(700)),
        ("c", torch.randn(2, 2).bfloat16()),
        ("d", torch.randn(4)),
    ]
    layout, buckets = pack(tensors, bucket_mb=2000 * 4 / 2**20)  # 2000 floats: a and b share one, then d its own
    assert [b.dtype for b in buckets] == [torch.float32, torch.bfloat16, torch.float32]
    assert [(n, bucket) for n, _, _, bucket, _ in layout] == [("a", 0), ("b", 0), ("c", 1), ("d", 2)]
    assert all(torch.equal(x, y) and n == m for (n, x), (m, y) in zip(tensors, unpack(layout, buckets)))
    assert bucket_sums(buckets)[2] == (
        tensors[3][1].double().sum().item(),
        tensors[3][1].double().square().sum().item(),
    )


def test_a_rollout_whose_engine_log_probs_are_not_the_policys_stops_the_run_naming_the_gap():
    """The probe is the same prompt on every rank; an engine wrong only on the rollout's own requests
    (a tensor-parallel group whose ranks sent different ones: 1.4 nats in fp32) passed it. The step's
    sampled tokens are compared too: only those of the weights the trainer scored them with, and only
    where the engine's distribution is the trainer's."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from weight_sync import check_rollout

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        args = SimpleNamespace(dtype="fp32", engine_logprobs=True, top_k=-1, top_p=1.0, lora_dropout=0.0)
        trainer = -torch.rand(4, 3) - 0.1  # [N, R]
        mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float)
        kw = dict(step=5, args=args, device="cpu")
        assert check_rollout(trainer, trainer + 1e-6, mask, [4] * 4, **kw) < 1e-5  # fp32's own error
        wrong = trainer.clone()
        wrong[1, 1] -= 1.4  # one token of a rank's sample
        with pytest.raises(WeightSyncError, match=r"step 5: the engine's log-probs .* 0.156 nats .* over 9 tokens"):
            check_rollout(trainer, wrong, mask, [4] * 4, **kw)
        assert check_rollout(trainer, wrong, mask, [4, 3, 4, 4], **kw) < 1e-5  # that sample is a version older
        args.dtype = "bf16"  # its rounding alone: 0.04 nats on average (SmolLM2)
        assert check_rollout(trainer, wrong, mask, [4] * 4, **kw) == pytest.approx(1.4 / 9)
        with pytest.raises(WeightSyncError, match="at most 0.25 expected in bf16"):
            check_rollout(trainer, trainer - 0.3, mask, [4] * 4, **kw)
        args.top_k = 20  # the engine's log-probs are over the 20 kept tokens: not comparable
        assert check_rollout(trainer, wrong, mask, [4] * 4, **kw) is None
    finally:
        dist.destroy_process_group()
