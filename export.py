"""Export: a checkpoint's policy in Hugging Face format, loadable by transformers and vLLM.

    python export.py runs/grpo/global_step_200 my_model    # whatever number of ranks saved it

A model (final_model too) is written aside and renamed into place when complete; its grpo_step.json
says which step it holds, so a run that finished can tell a final model that its last save did not
complete (final_model_problem). A LoRA checkpoint holds the adapters only: they are written twice, as
a PEFT adapter directory and merged into their base as a plain model. Export runs no code from the
checkpoint: every from_pretrained passes trust_remote_code=False, and a config that names code
(auto_map) is refused.
"""

import json
import os
import shutil

import torch
import torch.distributed.checkpoint as dcp

import integrity
import lora
import safe_write

MODEL_STEP = "grpo_step.json"  # in an exported model: the step its weights are from


def write_hf(state_dict, config, generation_config, tokenizer, out_dir, step=None, dtype=torch.float32):
    """Write a full state dict as a Hugging Face model: safetensors with the weights in `dtype`
    (config.json's dtype says which), config, generation config, tokenizer with its chat template.
    Loadable by AutoModelForCausalLM.from_pretrained and vLLM.
    With `step` (the training step the weights are from), also out_dir/grpo_step.json, which
    final_model_problem reads.

    Weights that hold an inf or a NaN are refused (NonFiniteError) before anything is written. The
    model is written to out_dir.tmp and renamed to out_dir only when complete, so a crash mid-write
    never leaves a half-written model, nor deletes the previous one, under out_dir. A write that
    fails raises WriteError (the path; "no space left on device" when the disk is full) and removes
    out_dir.tmp; out_dir stays as it was."""
    from transformers import AutoModelForCausalLM

    out_dir = os.path.normpath(out_dir)
    state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    bad = safe_write.first_nonfinite(state_dict.items())  # after the cast: a weight past bf16's range would be inf
    if bad is not None:
        raise safe_write.nonfinite_error(
            bad, out_dir, "Export an earlier checkpoint, or resume from one with a smaller --lr."
        )
    with torch.device("meta"):  # a skeleton of the right class, filled with the given tensors
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    model.load_state_dict(state_dict, assign=True, strict=False)
    model.tie_weights()
    if generation_config is not None:
        model.generation_config = generation_config
    tmp = out_dir + ".tmp"
    try:
        safe_write.prepare_dir(out_dir)
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if step is not None:
            with open(os.path.join(tmp, MODEL_STEP), "w") as f:
                json.dump({"step": step}, f)
        safe_write.publish_dir(tmp, out_dir)
    except Exception as e:
        todo = f"write it again from a checkpoint: python export.py <out-dir>/global_step_N {out_dir}"
        error = safe_write.write_error(e, getattr(e, "filename", None) or tmp, f"writing the model {out_dir}", todo)
        shutil.rmtree(tmp, ignore_errors=True)
        raise error from e


def check_no_code(model_dir):
    """Refuse a model or checkpoint directory whose config or tokenizer config names Python code to
    run (auto_map): loading it would run that code, and we never run code from a checkpoint."""
    for name in ("config.json", "tokenizer_config.json"):
        file = os.path.join(model_dir, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file) as f:
                auto_map = json.load(f).get("auto_map")
        except (ValueError, AttributeError) as e:
            raise SystemExit(f"{file} is not a JSON object ({e})") from None
        if auto_map:
            raise SystemExit(
                f"{file} names custom code to run (auto_map: {json.dumps(auto_map)}), and export.py never runs "
                "code from a model or checkpoint. If the model is a transformers architecture, remove auto_map from "
                "that file (and set model_type to the architecture's); otherwise export it with its own code."
            )


def export(checkpoint, out_dir, base=None, adapter_dir=None, dtype=None):
    """Checkpoint -> Hugging Face format, in one process, whatever number of ranks saved it. The
    weights are written in `dtype` ("bf16" or "fp32"; by default the run's compute dtype, its --dtype
    as trainer_state.json records it, as final_model would be).

    A LoRA checkpoint holds the adapters only: they are loaded onto the base model (`base`, by
    default the run's --model) and written twice, as a PEFT adapter directory at adapter_dir
    (default: out_dir + "_adapter") and then merged into a plain model at out_dir. The merged model
    is written last, with the checkpoint's step in grpo_step.json: its presence says both are complete.

    Runs no code from the checkpoint: every from_pretrained passes trust_remote_code=False, and a
    config that names code (auto_map) is refused. Raises WriteError or NonFiniteError as write_hf."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    problem = integrity.problem_with(checkpoint)
    if problem:
        raise SystemExit(f"{checkpoint}: cannot export: {problem}")
    hf = os.path.join(checkpoint, "hf")
    check_no_code(hf)
    no_code = dict(trust_remote_code=False)
    config, lora_config = AutoConfig.from_pretrained(hf, **no_code), lora.read_config(hf)
    has_tokenizer = os.path.isfile(os.path.join(hf, "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(hf, **no_code) if has_tokenizer else None
    generation_config = GenerationConfig.from_pretrained(hf)  # plain JSON: it has no code to run
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        state = json.load(f)
    dtype = torch.bfloat16 if (dtype or state["config"].get("dtype")) == "bf16" else torch.float32
    shards = integrity.SafeReader(os.path.join(checkpoint, "shards"))
    if lora_config is None:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, **no_code)
        full = {"model": {k: torch.empty(v.shape, dtype=v.dtype) for k, v in skeleton.state_dict().items()}}
        dcp.load(full, storage_reader=shards, no_dist=True)
        write_hf(full["model"], config, generation_config, tokenizer, out_dir, state["step"], dtype)
        print(f"exported {checkpoint} to {out_dir}")
        return
    base = base or state["config"]["model"]
    if os.path.isdir(base):
        check_no_code(base)
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **no_code)
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"{checkpoint} holds LoRA adapters; their base model {base!r} does not load ({e}); pass --base DIR"
        ) from None
    from peft import get_peft_model

    model = get_peft_model(model, lora_config)
    lora.check_fingerprint(state.get("base_fingerprint"), lora.base_fingerprint(model), f"{checkpoint} on base {base}")
    adapters = {"model": {n: torch.empty_like(p) for n, p in model.named_parameters() if p.requires_grad}}
    dcp.load(adapters, storage_reader=shards, no_dist=True)
    model.load_state_dict(adapters["model"], strict=False)
    merged = dict(lora.merged_parameters(model, torch.float32))
    bad = safe_write.first_nonfinite(merged.items())
    if bad is not None:
        raise safe_write.nonfinite_error(
            bad, out_dir, "Export an earlier checkpoint, or resume from one with a smaller --lr."
        )
    adapter_dir = adapter_dir or os.path.normpath(out_dir) + "_adapter"
    try:
        lora.write_adapter(
            {k.replace(f".{lora.ADAPTER}.", "."): v for k, v in adapters["model"].items()}, lora_config, adapter_dir
        )
    except Exception as e:
        todo = f"run this export again: python export.py {checkpoint} {out_dir}"
        raise safe_write.write_error(
            e, getattr(e, "filename", None) or adapter_dir, f"writing the adapter {adapter_dir}", todo
        ) from e
    write_hf(merged, config, generation_config, tokenizer, out_dir, state["step"], dtype)
    print(f"exported {checkpoint}: the merged model to {out_dir}, the adapter to {adapter_dir}")


def final_model_problem(out_dir, checkpoint):
    """Why <out_dir>/final_model is not the export of `checkpoint` (the run's newest), or None if it is.

    For the start of a run that has finished: a crash while the final model was written leaves no
    final_model, or an unfinished final_model.tmp, or the final model of an earlier end of the run
    (before --max-steps was raised). The final model is written last, with the step of its weights
    in grpo_step.json (write_hf), so a final_model holding the checkpoint's step is complete, and so
    is a LoRA run's final_adapter when it is written before the final model (export() does that).
    To repair: export(checkpoint, final_model, adapter_dir=final_adapter), or save the loaded policy
    again (policy.save_hf)."""
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        step = json.load(f)["step"]
    final = os.path.join(out_dir, "final_model")
    if os.path.isdir(final + ".tmp"):
        return f"{final}.tmp is a final model whose writing was interrupted"
    if not os.path.isdir(final):
        return f"{final} is missing"
    try:
        with open(os.path.join(final, MODEL_STEP)) as f:
            saved = json.load(f)["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{final} has no readable {MODEL_STEP}, so nothing says which step it holds"
    if saved != step:
        return f"{final} holds step {saved}, and the newest checkpoint, {checkpoint}, step {step}"
    return None


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a global_step_N directory")
    parser.add_argument("out_dir", help="where to write the model (with LoRA: the base with the adapters merged in)")
    parser.add_argument("--base", default=None, help="LoRA: the base model's directory (default: the run's --model)")
    parser.add_argument(
        "--adapter-out", default=None, help="LoRA: where to write the PEFT adapter (default: OUT_DIR_adapter)"
    )
    parser.add_argument(
        "--dtype", choices=("bf16", "fp32"), default=None, help="the weights' dtype (default: the run's --dtype)"
    )
    args = parser.parse_args()
    try:
        export(args.checkpoint, args.out_dir, args.base, args.adapter_out, args.dtype)
    except (safe_write.WriteError, safe_write.NonFiniteError) as e:  # the message says what happened and what to do
        raise SystemExit(str(e)) from None
