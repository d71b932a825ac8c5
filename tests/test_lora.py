"""lora.py: LoRA adapters on the frozen base. The merged weights the engine gets are PEFT's own
merge, the reference is the base, the adapter files load in PEFT; end to end, the engine samples
from the trained adapters, checkpoints hold the adapters only, and export gives both forms."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, check_saved_model, metrics, run_script

import lora
from models import build_tiny_model
from tasks.digits import TASK_WORDS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "tiny"
    build_tiny_model(path, TASK_WORDS, seed=0)
    return path


def peft_model(path, rank=4, targets="all-linear", seed=0):
    """The tiny model with LoRA adapters whose B is random (PEFT starts it at 0: no change to see)."""
    from transformers import AutoModelForCausalLM

    model = lora.add_adapters(AutoModelForCausalLM.from_pretrained(path), rank, 8.0, targets, 0.0)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    return model


def test_only_the_adapters_train_and_the_lm_head_has_none(tiny):
    model = peft_model(tiny)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert not any("lm_head" in n for n in trained)
    assert set(lora.lora_layers(model)) == {
        f"base_model.model.model.layers.{i}.{m}"
        for i in range(2)
        for m in "self_attn.q_proj self_attn.k_proj self_attn.v_proj self_attn.o_proj mlp.gate_proj mlp.up_proj mlp.down_proj".split()
    }
    only_q = peft_model(tiny, targets="q_proj, v_proj")
    assert {n.rsplit(".", 1)[1] for n in lora.lora_layers(only_q)} == {"q_proj", "v_proj"}
    with pytest.raises(SystemExit, match="--lora-target-modules no_such_proj"):
        peft_model(tiny, targets="no_such_proj")


def test_an_adapter_on_a_tied_head_is_refused_and_on_an_untied_head_is_synced(tiny, tmp_path):
    # tied: the engine never got the head's delta and the export re-tied it away (final_model == the base)
    with pytest.raises(SystemExit, match="ties its LM head to the input embeddings"):
        peft_model(tiny, targets="lm_head")
    with pytest.raises(SystemExit, match="ties its LM head"):
        peft_model(tiny, targets="q_proj,lm_head")
    from transformers import AutoModelForCausalLM

    from models import build_random_model

    untied = tmp_path / "untied"
    build_random_model(str(untied), str(tiny), tie_word_embeddings=False)
    model = peft_model(untied, targets="lm_head")
    merged = dict(lora.merged_parameters(model, torch.float32))
    reference = model.merge_and_unload().state_dict()
    torch.testing.assert_close(merged["lm_head.weight"], reference["lm_head.weight"], rtol=0, atol=1e-6)
    base = AutoModelForCausalLM.from_pretrained(untied).lm_head.weight
    assert not torch.equal(merged["lm_head.weight"], base)  # the delta is there


def test_merged_parameters_are_peft_merge_with_the_base_names(tiny):
    """What the engine and final_model get: W + scale * B @ A under the base model's names."""
    from transformers import AutoModelForCausalLM

    model = peft_model(tiny)
    merged = dict(lora.merged_parameters(model, torch.float32))
    reference = model.merge_and_unload().state_dict()  # PEFT's own merge (changes the model in place)
    base_names = dict(AutoModelForCausalLM.from_pretrained(tiny).named_parameters())
    assert set(merged) == set(base_names)  # every parameter once, with the names vLLM and transformers use
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6)
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], base_names["model.layers.0.self_attn.q_proj.weight"]
    )
    assert (
        lora.hf_name("base_model.model.model.layers.3.mlp.up_proj.base_layer.weight")
        == "model.layers.3.mlp.up_proj.weight"
    )


def test_reference_mode_is_the_base_model(tiny):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny)
    model = peft_model(tiny)
    ids = torch.tensor([[1, 5, 7, 9, 4, 3]])
    with torch.no_grad():
        with lora.reference_mode(model):
            off = model(input_ids=ids).logits
        on = model(input_ids=ids).logits
        torch.testing.assert_close(off, base(input_ids=ids).logits, rtol=0, atol=1e-6)
    assert (on - off).abs().max() > 1e-3  # the adapters are back on outside the block


def test_adapter_files_load_in_peft_and_give_the_merged_model(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = peft_model(tiny)
    lora.save_adapter(model, tmp_path / "adapter", rank=0)
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tiny)
    merged.load_state_dict(dict(lora.merged_parameters(model, torch.float32)), strict=False)
    ids = torch.tensor([[1, 5, 7, 9, 4, 3]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-6)
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_fingerprint_tells_base_models_apart(tiny):
    a, b = peft_model(tiny), peft_model(tiny)
    assert lora.base_fingerprint(a) == lora.base_fingerprint(b)  # adapters do not count
    lora.check_fingerprint(lora.base_fingerprint(a), lora.base_fingerprint(b), "here")
    with torch.no_grad():
        b.base_model.model.model.layers[1].mlp.down_proj.base_layer.weight[0, 0] += 1e-3
    with pytest.raises(SystemExit, match="other base weights"):
        lora.check_fingerprint(lora.base_fingerprint(a), lora.base_fingerprint(b), "here")
    lora.check_fingerprint(None, lora.base_fingerprint(b), "a full fine-tuning checkpoint has none")


# ----------------------------------------------------------------------------------------------
# end to end

LORA_RUN = (
    "--lora-rank 8 --lora-alpha 16 --lr 5e-3 --kl-coef 0.05 --max-steps 4 --prompt-batch-size 16 --mini-batch-size 16 "
    "--group-size 4 --test-freq 2 --val-max-prompts 16 --save-freq 2"
).split()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """4 LoRA steps on vLLM, 2 ranks, one optimizer step each, with a KL loss to the base."""
    out = tmp_path_factory.mktemp("lora_run")
    run_script("--out-dir", str(out), "--rollout", "vllm", *LORA_RUN, ranks=2)
    return out


@pytest.mark.slow
def test_engine_samples_from_the_trained_adapters(lora_run):
    """verl#7495 (an adapter that never reached vLLM) shows here as a gap: the trainer scores every
    sampled token with the current adapters; the engine sampled it with the synced weights."""
    rows = [r for r in metrics(lora_run) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["training/rollout_logprob_diff_max"] <= 1e-4, r
    assert rows[0]["actor/kl_loss"] == 0  # step 1's first optimizer step: the policy is the base exactly
    assert rows[-1]["actor/kl_loss"] > 1e-6  # later the adapters have moved it away from its reference
    from safetensors.torch import load_file

    final = load_file(lora_run / "final_model" / "model.safetensors")
    base = load_file(lora_run / "tiny_model" / "model.safetensors")
    moved = [k for k in base if not torch.equal(final[k], base[k])]
    assert moved and all(k.split(".")[-2].endswith("proj") for k in moved)  # the adapted layers, nothing else


@pytest.mark.slow
def test_lora_checkpoint_holds_the_adapters_only(lora_run):
    ckpt = lora_run / "global_step_4"
    assert os.path.isfile(ckpt / "hf" / "adapter_config.json")
    state = json.load(open(ckpt / "trainer_state.json"))
    assert isinstance(state["base_fingerprint"], float)
    shards = sum(os.path.getsize(ckpt / "shards" / f) for f in os.listdir(ckpt / "shards"))
    model = os.path.getsize(lora_run / "tiny_model" / "model.safetensors")
    assert shards < model / 2  # adapters + their AdamW moments (8% of the tiny model each), no base weights;
    # full training's checkpoint is 3x the model
    index = checkpoint_keys(ckpt)
    assert index and all(".lora_A." in k or ".lora_B." in k for k in index), index[:5]


def checkpoint_keys(ckpt):
    import integrity

    return sorted(
        {
            k.split(".", 1)[1]
            for k in integrity.read_index(str(ckpt / "shards" / ".metadata")).state_dict_metadata
            if k.startswith("model.")
        }
    )


@pytest.mark.slow
def test_final_model_and_adapter_load_without_the_trainer(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    questions = [f"list 1 2 3 4 5 {d} last" for d in range(4)]
    assert check_saved_model(lora_run / "final_model", questions) <= 1e-4  # transformers and vLLM, no PEFT
    merged = AutoModelForCausalLM.from_pretrained(lora_run / "final_model")
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(lora_run / "tiny_model"), lora_run / "final_adapter"
    )
    ids = torch.tensor([[1, 5, 7, 9, 4, 3]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=0, atol=1e-5)
    # export of the last checkpoint (saved by 2 ranks, exported by one process) gives both again
    out = tmp_path / "exported"
    proc = subprocess.run(
        [sys.executable, "export.py", str(lora_run / "global_step_4"), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    exported, final = load_file(out / "model.safetensors"), load_file(lora_run / "final_model" / "model.safetensors")
    assert set(exported) == set(final) and all(torch.equal(exported[k], final[k]) for k in final)
    adapter = load_file(tmp_path / "exported_adapter" / "adapter_model.safetensors")
    assert adapter.keys() == load_file(lora_run / "final_adapter" / "adapter_model.safetensors").keys()
