"""LoRA: GRPO that trains low-rank adapters on a frozen base model (PEFT); four places change.
Each targeted linear layer W (out x in) gets two small matrices, A (r x in) and B (out x r), and
computes x W^T + scale * x A^T B^T with scale = alpha / r. B starts at zero, so step 0 is the base
model. Only A and B are trained; with rank 16 on SmolLM2-135M they are 3.6% of the parameters.
1. The reference model is the base itself: the policy with its adapters switched off
   (`reference_mode`). No second copy of the model, as in verl.
2. The engine samples from the merged weights W + scale * B @ A, streamed one parameter at a
   time exactly like full training's (`merged_parameters`). A sync that forgot the adapters would
   leave the engine on the base model; the engine-vs-trainer log-prob gap (--engine-logprobs)
   shows it, and a test holds it under 1e-4 after several updates.
3. Checkpoints hold the adapters and their optimizer state only; the base comes from --model
   again on resume, and `base_fingerprint` makes sure it is the same one.
4. A run ends with final_model/ (merged: loads without PEFT) and final_adapter/ (PEFT's format).
LoRA wants about 10x full fine-tuning's learning rate (Schulman et al., "LoRA Without Regret").
"""

import json
import os

import torch

import safe_write
from distributed import full_tensor

ADAPTER = "default"  # PEFT's name for a model's only adapter


def add_adapters(model, rank, alpha, target_modules, dropout):
    """Wrap a transformers model in PEFT's LoRA: adapters on `target_modules` ("all-linear": every
    linear layer of the blocks, not the LM head), the base frozen. Returns the PeftModel."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear

    targets = target_modules if target_modules == "all-linear" else [t.strip() for t in target_modules.split(",")]
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none")
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    try:
        model = get_peft_model(model, config)
    except ValueError as e:  # e.g. a target that names no module of this model
        raise SystemExit(f"--lora-target-modules {target_modules}: {e}") from None
    if tied and any(layer.get_base_layer() is head for layer in lora_layers(model).values()):
        # the head's delta would untie it from the embedding: the engine (loaded tied) never sees it,
        # and an exported model, tied again, is the base model
        raise SystemExit(f"--lora-target-modules {target_modules}: {TIED_HEAD}")
    kinds = {type(m).__name__ for m in lora_layers(model).values() if not isinstance(m, Linear)}
    if kinds:  # merged_parameters knows the linear layer's delta only
        raise SystemExit(f"--lora-target-modules {target_modules}: LoRA here supports linear layers only, not {kinds}")
    return model


TIED_HEAD = (
    "this model ties its LM head to the input embeddings (tie_word_embeddings), and an adapter on the head "
    "alone cannot be synced to the engine or exported. Leave the head out (all-linear does), or train it with "
    "full fine-tuning (no --lora-rank)."
)


def check_targets(model_path, target_modules):
    """Before anything loads: refuse an adapter on the LM head of a model whose head is its input
    embedding (add_adapters checks the loaded model too, whatever the head's name)."""
    from transformers import AutoConfig

    targets = {t.strip() for t in target_modules.split(",")}
    tied = getattr(AutoConfig.from_pretrained(model_path, trust_remote_code=False), "tie_word_embeddings", False)
    if tied and "lm_head" in targets:
        raise SystemExit(f"--lora-target-modules {target_modules}: {TIED_HEAD}")


def is_lora(model):
    return hasattr(model, "peft_config")


def lora_layers(model):
    """{module name: PEFT LoRA layer} of a PeftModel (sharded or not)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def hf_name(peft_name):
    """A PeftModel's parameter name -> the base model's: 'base_model.model.model.layers.0.q_proj.base_layer.weight'
    -> 'model.layers.0.q_proj.weight'."""
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def reference_mode(model):
    """Context manager: inside it the policy is the base model (adapters off), the KL reference."""
    return model.disable_adapter()


@torch.no_grad()
def merged_parameters(model, dtype):
    """Yields (hf_name, full tensor) of the base model with every adapter merged in, one parameter
    at a time and in the same order on every rank (each full_tensor() is a collective):

        W' = W + scale * B @ A        # [out, in] = [out, r] @ [r, in]
    """
    layers = lora_layers(model)
    for name, param in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        if ".lora_" in name:
            continue  # merged into its base layer's weight
        tensor = full_tensor(param).detach()
        owner = module.removesuffix(".base_layer")
        if leaf == "weight" and module.endswith(".base_layer") and owner in layers:
            layer = layers[owner]
            a, b = full_tensor(layer.lora_A[ADAPTER].weight), full_tensor(layer.lora_B[ADAPTER].weight)
            delta = (b.float() @ a.float()) * layer.scaling[ADAPTER]  # [out, in]
            tensor = tensor.float() + (delta.T if layer.fan_in_fan_out else delta)
        yield hf_name(name), tensor.to(dtype)


def save_adapter(model, out_dir, rank):
    """Write the adapters in PEFT's format (adapter_config.json, adapter_model.safetensors), so that
    PeftModel.from_pretrained(base, out_dir) loads them. Every rank takes part; rank 0 writes. Like
    policy.save_hf, weights that are not finite, and a write that fails, raise on every rank."""
    adapters = [(n, p) for n, p in model.named_parameters() if ".lora_" in n]
    safe_write.check_finite(adapters, out_dir, "Resume from a checkpoint before the divergence with a smaller --lr.")
    state = {}
    for name, param in adapters:  # PEFT's files name the tensors without the adapter's name
        state[name.replace(f".{ADAPTER}.", ".")] = full_tensor(param).detach().cpu().contiguous()
    error = None
    if rank == 0:
        try:
            write_adapter(state, model.peft_config[ADAPTER], out_dir)
        except Exception as e:  # told to every rank, which would otherwise wait for rank 0
            error = safe_write.write_error(
                e, out_dir + ".tmp", f"writing the adapter {out_dir}", "run the same command again"
            )
    failure = safe_write.first_failure(error)  # and a barrier
    if failure is not None:
        raise failure


def write_adapter(state, peft_config, out_dir):
    """Adapter tensors (PEFT's names) and their LoraConfig -> a PEFT adapter directory, written to
    out_dir.tmp and put in out_dir's place when complete (safe_write.publish_dir)."""
    from safetensors.torch import save_file

    tmp = safe_write.prepare_dir(out_dir)
    peft_config.save_pretrained(tmp)
    save_file(state, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    safe_write.publish_dir(tmp, out_dir)


@torch.no_grad()
def base_fingerprint(model):
    """One number that identifies the frozen base weights: a LoRA checkpoint holds only the
    adapters, and resuming them on another base would train a model nobody asked for. Sums over
    the full tensors, so any number of ranks computes the same value (to rounding)."""
    total = 0.0
    for param in model.parameters():
        if not param.requires_grad:
            t = full_tensor(param).double()
            total += (t.sum() + t.square().sum() * 1e-3).item()
    return total


def check_fingerprint(saved, now, where):
    """Refuse adapters trained on another base model."""
    if saved is not None and now is not None and abs(saved - now) > 1e-9 * max(1.0, abs(saved)):
        raise SystemExit(
            f"{where}: these LoRA adapters were trained on other base weights (fingerprint {saved!r}, now {now!r}); "
            "pass the --model the run was started with"
        )


def read_config(path):
    """The LoraConfig saved in a checkpoint's hf/ directory, or None for a full fine-tuning checkpoint."""
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        return None
    from peft import LoraConfig

    with open(file) as f:
        json.load(f)  # a clear error for a corrupt file, before PEFT's
    return LoraConfig.from_pretrained(path)
