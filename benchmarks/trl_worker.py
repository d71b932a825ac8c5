"""One run of TRL's GRPOTrainer configured to do our step's work, in its own process. runners.run_trl
writes the spec file and starts this; it writes one line per step to OUT_DIR/steps.jsonl.

    python benchmarks/trl_worker.py runs/bench_vs_trl/runs/NAME/spec.json

What makes it our step's work: the same model, tokenizer and prompts in the same order, n samples per
prompt, max new tokens, one optimizer step per generation batch (torch AdamW, constant lr, clip 0.2,
gradient clip 1), the dapo loss (our token-mean), no KL term, no reference model, gradient
checkpointing off, and our reward scoring the text ours scores. The step time is that of a
TrainerCallback from on_step_begin to on_step_end: generation, reward, advantages and the update; the
dataloader fetch and TRL's logging fall outside, as our logging does. Generated tokens are counted
with the EOS, as ours counts them. Peak memory is measured as train_grpo.py measures its own.
"""

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's reward.py

# TRL's generation modes, as the benchmarks name them, and the GRPOConfig fields that select them. On CPU
# vllm_colocate cannot copy the new weights into vLLM (../shared/PLATFORM.md), so it fails there; TRL's vLLM
# server mode refuses non-CUDA devices outright (trl/generation/vllm_client.py) and is not listed.
TRL_ENGINES = {
    "generate": dict(use_vllm=False),
    "continuous_batching": dict(use_vllm=False, use_transformers_continuous_batching=True),
    "vllm_colocate": dict(use_vllm=True, vllm_mode="colocate"),
}


def train(spec):
    """One GRPOTrainer run configured to do our step's work; writes out_dir/steps.jsonl."""
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


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "spec",
        help="a JSON file with model, prompts (a jsonl of prompt, data_source, ground_truth), out_dir, "
        "engine, prompts_per_step, n, length, steps, lr, seed, max_model_len, passes, bf16",
    )
    train(json.load(open(p.parse_args().spec)))
