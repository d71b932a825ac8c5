"""The run's log: every step's metrics (verl's names), where they go, and readable samples.

    --logger console,jsonl                 the default: a progress bar and one line per validation,
                                           and <out-dir>/metrics.jsonl, one JSON row per step
    --logger console,jsonl,tensorboard     + <out-dir>/tensorboard: every scalar under the same
                                           name, histograms of scores, advantages and response
                                           lengths, and sample tables as text
    --logger console,jsonl,wandb --wandb-project NAME

metrics.jsonl is the run's record: checkpoints carry the same history, so a resumed run rewrites
it whole, and the health report (report.py) reads it. Samples go to <out-dir>/samples/: the first
prompt's group of every training step (train.jsonl), and the first validation samples
(val_step_<step>.jsonl). Every rank calls log() with the same (reduced) metrics; rank 0 writes.
"""

import json
import math
import os
import resource
import time
from contextlib import contextmanager

import numpy as np
import torch

from advantage import zero_std_fraction
from distributed import all_gather, all_sum, print0, reduce_metrics
from health import FIRST_STEP
from multi_turn import turn_counts, turn_metrics
from trl_rewards import function_metrics
from weight_sync import check_rollout

# ----------------------------------------------------------------------------------------------
# A step's metrics, verl's names


def memory_gb(device):
    """Peak memory of this process: the GPU's allocator on CUDA, the resident set on CPU (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def rollout_metrics(scores, advantages, response_lengths, prompt_lens, truncated, extras, group_size, device=None):
    """Metrics of this rank's rollout: scores and advantages [N], response_lengths [N] (every token after
    the prompt, a tool's too, as verl counts them), prompt_lens [N], truncated [N] bools, extras: the
    reward's extra keys (reward.score_responses). Per-token advantages (a token-level estimator) are
    averaged over every rank's tokens (`device` for the sum), as they would be on one rank."""
    metrics = {}
    columns = dict(score=torch.tensor(scores, dtype=torch.float), advantages=advantages.float())
    lengths = torch.tensor(response_lengths, dtype=torch.float)
    columns.update(response_length=lengths, prompt_length=torch.tensor(prompt_lens, dtype=torch.float))
    for name, values in columns.items():
        prefix = f"critic/{name}" if name in ("score", "advantages") else name
        metrics.update(
            {
                f"{prefix}/mean": values.mean().item(),
                f"{prefix}/max": values.max().item(),
                f"{prefix}/min": values.min().item(),
            }
        )
    if device is not None and len(advantages) != len(scores):  # per token: ranks hold different token counts
        metrics["critic/advantages/mean"] = all_sum(advantages.double().sum().item(), device) / max(
            all_sum(len(advantages), device), 1
        )
    metrics["response_length/clip_ratio"] = float(np.mean(truncated))
    metrics["frac_reward_zero_std"] = zero_std_fraction(scores, group_size)
    if any(k.startswith("rewards/") for k in extras):  # TRL's: rewards/<name>/mean and /std, where each applied
        metrics.update(function_metrics([extras]))
    for key, values in extras.items():
        numeric = [float(v) for v in values if isinstance(v, (int, float))]
        if key.startswith(TRL_KEYS[1]) and numeric:  # log_metric(name, value): under its own name
            metrics[key.removeprefix(TRL_KEYS[1])] = sum(numeric) / len(numeric)
        elif numeric and not key.startswith(TRL_KEYS):  # log_extra's columns go to the samples, not here
            metrics[f"reward_extra/{key}/mean"] = sum(numeric) / len(numeric)
    return metrics


# The extras keys of TRL-style reward functions (trl_rewards.score_rows): rewards/<name>, log_metric/<name>,
# log_extra/<column>
TRL_KEYS = ("rewards/", "log_metric/", "log_extra/")


def token_mean(values, device):
    """The mean of `values` (a 1-d tensor: this rank's tokens) over every rank's tokens; 0 without any."""
    return all_sum(values.double().sum().item(), device) / max(all_sum(values.numel(), device), 1)


def engine_gap_metrics(trainer_logp, engine_logp, mask, device, off_policy=False):
    """How far the engine's sampling distribution is from the trained policy, on the sampled tokens
    (verl's training/rollout_*): log-probs [N, R] from each, mask [N, R]. off_policy (--max-staleness):
    the engine's are the behaviour policy's and the trainer's the proximal one's; adds rollout_corr/*.
    Means are over every rank's tokens (ranks hold different token counts), so 1 and 2 ranks log the same."""
    tokens = mask.bool()
    log_w = (trainer_logp - engine_logp)[tokens]  # [tokens] log pi_trainer - log pi_engine
    prob_gap = (trainer_logp.exp() - engine_logp.exp())[tokens].abs()
    metrics = {
        "training/rollout_probs_diff_max": prob_gap.max().item() if log_w.numel() else 0.0,
        "training/rollout_probs_diff_mean": token_mean(prob_gap, device),
        "training/rollout_logprob_diff_max": log_w.abs().max().item() if log_w.numel() else 0.0,
    }
    if not off_policy:
        return metrics
    # the decoupled loss's importance weights pi_prox / pi_behav before the cap, and KL(behav || prox), from
    # the behaviour policy's samples: k1 = E[log pi_behav - log pi_prox], k3 = E[w - 1 - log w]
    metrics["rollout_corr/is_weight/mean"] = token_mean(log_w.exp(), device) if log_w.numel() else 1.0
    metrics["rollout_corr/is_weight/max"] = log_w.exp().max().item() if log_w.numel() else 1.0
    metrics["rollout_corr/kl"] = token_mean(-log_w, device)
    metrics["rollout_corr/k3_kl"] = token_mean(log_w.exp() - 1 - log_w, device)
    return metrics


def loss_metrics(stats, device):
    """actor/<name> for every number the loss reported (a name with its own prefix, distill/..., keeps it), each
    micro-batch's token mean weighted by its tokens over all micro-batches of all ranks, or for a name ending in
    _max or _min this rank's extreme (reduce_metrics takes it over ranks); actor/grad_norm averaged over optimizer
    steps. `stats`: one dict per micro-batch, with "tokens", and "grad_norm" on each optimizer step's last."""
    total = max(all_sum(sum(s["tokens"] for s in stats), device), 1)
    keys = sorted({k for s in stats for k in s} - {"tokens", "grad_norm"})  # the same on every rank
    metrics = {}
    for k in keys:
        name = k if "/" in k else f"actor/{k}"
        if k.endswith(("_max", "_min")):  # a micro-batch without tokens has none
            pick = max if k.endswith("_max") else min
            metrics[name] = pick((s[k] for s in stats if k in s), default=pick(-math.inf, math.inf))
        else:
            metrics[name] = all_sum(sum(s.get(k, 0.0) * s["tokens"] for s in stats), device) / total
    grad_norms = [s["grad_norm"] for s in stats if "grad_norm" in s]  # equal on all ranks
    metrics["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
    return metrics


def step_metrics(ro, *, step, stats, adv_values, mask, trainer_logp, engine_logp, lr, skipped, timing, args, device):
    """A training step's metrics under verl's names, reduced over ranks: the loss terms (`stats`, one
    dict per micro-batch), the rollout's rewards, lengths and advantages (`ro`: rollout.StepRollout;
    `adv_values` per token or per sample; `mask` [N, R]: the model's tokens, before --mask-truncated), the
    engine-vs-trainer gap ([N, R] log-probs; weight_sync.check_rollout stops the run if the engine did not
    sample from the policy), the phases' times and the throughput; multi-turn, num_turns/* and tool/*
    (multi_turn.turn_metrics) over every rank's samples."""
    prompt_lens = [len(r["prompt_ids"]) for r in ro.rows for _ in range(args.group_size)]
    lengths = [len(ids) for ids in ro.response_ids]
    metrics = {"actor/lr": lr, **loss_metrics(stats, device), **ro.filter_metrics}
    metrics.update(
        rollout_metrics(ro.scores, adv_values, lengths, prompt_lens, ro.truncated, ro.extras, args.group_size, device)
    )
    if ro.turns:
        metrics.update(turn_metrics(sum(all_gather(turn_counts(ro.turns)), [])))
    if skipped:
        metrics["actor/skipped_updates"] = skipped
    if args.reward_errors == "skip":  # samples whose reward function failed, scored 0: all ranks
        metrics["reward/errors"] = all_sum(sum(ro.extras["reward_error"]), device)
    check_rollout(trainer_logp, engine_logp, mask, ro.versions, step=step, args=args, device=device)
    if args.engine_logprobs:
        metrics.update(engine_gap_metrics(trainer_logp, engine_logp, mask, device, off_policy=args.max_staleness > 0))
    metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
    tokens = sum(lengths) + sum(prompt_lens)
    metrics["perf/total_num_tokens"] = all_sum(tokens, device)  # prompt + response tokens, all ranks
    metrics["perf/throughput"] = tokens / timing["step"]  # tokens/s per rank, as verl reports it
    metrics["perf/max_memory_allocated_gb"] = memory_gb(device)
    return reduce_metrics(metrics, device)


def sample_records(tokenizer, rows, texts, scores, extras=None):
    """Readable samples, {prompt, response, ground_truth, score}, for samples/*.jsonl and the tables; with the
    reward's `extras` (one value per sample, from the first), TRL-style functions' values (rewards/<name>) and
    the columns they gave log_extra. A prompt-only dataset's rows have no ground truth: None."""
    records = [
        dict(
            prompt=tokenizer.decode(r["prompt_ids"]),
            response=text,
            ground_truth=(r.get("reward_model") or {}).get("ground_truth"),
            score=score,
        )
        for r, text, score in zip(rows, texts, scores)
    ]
    for key, values in (extras or {}).items():
        if key.startswith((TRL_KEYS[0], TRL_KEYS[2])):
            for record, value in zip(records, values):
                record[key.removeprefix(TRL_KEYS[2])] = value
    return records


def should_stop(history, metric, patience):
    """Early stopping from the metric history alone (so a resumed run decides the same way): True
    when `metric` has not improved for `patience` validations."""
    values = [row[metric] for row in history if metric in row]
    if not metric or not values:
        return False
    best_at = max(range(len(values)), key=lambda i: (values[i], -i))  # the first time the best was reached
    return len(values) - 1 - best_at >= patience


def is_best(history, metric):
    """True when the last row's `metric` beats every earlier row's (the first value is the best)."""
    previous = [row[metric] for row in history[:-1] if metric in row]
    return not previous or history[-1][metric] > max(previous)


# ----------------------------------------------------------------------------------------------
# Where metrics go

# The bar's summary of a step: (metric, short name, format)
BAR = [
    ("actor/policy_loss", "policy_loss", ".4f"),
    ("actor/pg_loss", "pg_loss", ".4f"),
    ("actor/entropy", "entropy", ".4f"),
    ("actor/kl_loss", "kl_loss", ".5f"),
    ("critic/advantages/mean", "adv_mean", ".4f"),
    ("critic/score/mean", "reward", ".4f"),
    ("actor/grad_norm", "grad_norm", ".2f"),
]
SAMPLE_COLUMNS = ["step", "prompt", "response", "ground_truth", "score"]


class RunLog:
    """History, health warnings, loggers and samples of one run; see the module docstring."""

    def __init__(self, out_dir, config, loggers, monitor, rank, wandb_project="", wandb_run_name=""):
        self.out_dir, self.loggers, self.monitor, self.rank = out_dir, loggers, monitor, rank
        self.history = []  # every logged row; checkpoints carry it, so a resumed run's metrics.jsonl is whole
        self.timed = False  # whether this process has logged a training step yet (the first includes start-up)
        self.bar = self.wandb = self.tensorboard = None
        if rank != 0:
            return
        if "wandb" in loggers:
            import wandb

            wandb.init(project=wandb_project, name=wandb_run_name or None, config=config, dir=out_dir)
            self.wandb = wandb
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(os.path.join(out_dir, "tensorboard"))
            rows = "\n".join(f"| {k} | {v} |" for k, v in config.items())
            self.tensorboard.add_text("config", "| flag | value |\n| --- | --- |\n" + rows)

    def start(self, config, history, start_step, total_steps):
        """Rewrite the run's files to what the checkpoint knows (an empty history for a new run):
        config.json, metrics.jsonl, and train samples up to start_step; later rows are redone."""
        self.history = list(history)
        for row in self.history:  # the monitor picks up where it was, without repeating old warnings
            self.monitor.update(row)
        if self.rank == 0:
            with open(os.path.join(self.out_dir, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
            with open(os.path.join(self.out_dir, "metrics.jsonl"), "w") as f:
                f.writelines(json_line(row) for row in self.history)
            train_samples = os.path.join(self.out_dir, "samples", "train.jsonl")
            if os.path.exists(train_samples):
                kept = [line for line in open(train_samples) if json.loads(line)["step"] <= start_step]
                with open(train_samples, "w") as f:
                    f.writelines(kept)
        if self.rank == 0 and "console" in self.loggers:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="Training Progress", dynamic_ncols=True)

    def write(self, line):
        """A line on the console that does not break the progress bar."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print0(line)

    def log(self, step, metrics, histograms=None):
        """Record one step (step 0: the validation before training). histograms: {name: this rank's
        values}, gathered from every rank for TensorBoard. Call on every rank. The first training step of
        each process (a new or a resumed run) is marked perf/first_step_after_start: its time includes the
        start-up, so the health checks leave it out."""
        if "timing_s/step" in metrics and not self.timed:
            metrics, self.timed = {**metrics, FIRST_STEP: 1.0}, True
        self.history.append(dict(step=step, **metrics))
        for warning in self.monitor.update(self.history[-1]):  # the same on every rank: metrics are reduced
            self.write(f"health: {warning}")
        if histograms and "tensorboard" in self.loggers:  # a collective: every rank takes part
            histograms = {
                k: np.concatenate([np.asarray(p, dtype=np.float64) for p in all_gather(v)])
                for k, v in (histograms or {}).items()
            }
        if self.rank != 0:
            return
        with open(os.path.join(self.out_dir, "metrics.jsonl"), "a") as f:
            f.write(json_line(self.history[-1]))
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.tensorboard is not None:
            for name, value in metrics.items():
                self.tensorboard.add_scalar(name, value, step)
            for name, values in (histograms or {}).items():
                self.tensorboard.add_histogram(name, values, step)
            self.tensorboard.flush()
        validation = {k: v for k, v in metrics.items() if k.startswith("val-core")}
        if validation and "console" in self.loggers:
            self.write(f"step {step}: " + ", ".join(f"{k}={v:.4f}" for k, v in validation.items()))
        if self.bar is not None and step > 0:
            self.bar.set_postfix({short: f"{metrics[key]:{fmt}}" for key, short, fmt in BAR if key in metrics})
            self.bar.update(step - self.bar.n)

    def samples(self, name, step, samples, mode="a", table=None):
        """Write samples ({prompt, response, ground_truth, score}) to <out-dir>/samples/<name>
        (rank 0's; mode "a" appends, "w" replaces); with `table`, also as a wandb table and
        TensorBoard text under that name."""
        if self.rank != 0:
            return
        rows = [dict(step=step, **s) for s in samples]
        columns = SAMPLE_COLUMNS + [c for c in (rows[0] if rows else {}) if c not in SAMPLE_COLUMNS]  # + TRL's extras
        with open(os.path.join(self.out_dir, "samples", name), mode) as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        if table and self.wandb:
            self.wandb.log(
                {table: self.wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])}, step=step
            )
        if table and self.tensorboard is not None:
            lines = [" | ".join(str(r.get(c)).replace("|", "\\|").replace("\n", " ") for c in columns) for r in rows]
            self.tensorboard.add_text(
                table, "\n".join([" | ".join(columns), " | ".join(["---"] * len(columns)), *lines]), step
            )

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


def json_line(row):
    """One line of metrics.jsonl: strict JSON, so any reader parses it. A metric that is NaN or
    infinite (a diverged run) is written as null; report.read_run reads null back as NaN, and the
    report counts it as a problem."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


@contextmanager
def timed(timing, name):
    """with timed(timing, "gen"): ...  adds the block's wall time in seconds to timing["gen"] (and names the
    block in a --profile-step profile)."""
    start = time.perf_counter()
    with torch.profiler.record_function(name):
        yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def start_profile(step, args):
    """--profile-step N: a torch.profiler recording step N, the CPU's ops and CUDA's kernels; None at other steps."""
    if step != args.profile_step:
        return None
    from torch.profiler import ProfilerActivity, profile

    cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    profiler = profile(activities=[ProfilerActivity.CPU, *cuda])
    profiler.start()
    return profiler


def end_profile(profiler, step, args, rank):
    """Stop start_profile's recording; rank 0 writes its ops by self time on the GPU (on CUDA) and on the CPU, with
    the step's phases (timed's names) among them, to OUT_DIR/profile_step_N.txt."""
    if profiler is None:
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler.stop()
    if rank != 0:
        return
    events, path = profiler.key_averages(), os.path.join(args.out_dir, f"profile_step_{step}.txt")
    sorts = (["self_device_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total"]
    with open(path, "w") as f:
        for key in sorts:
            f.write(
                f"step {step}, sorted by {key}\n{events.table(sort_by=key, row_limit=40, max_name_column_width=60)}\n"
            )
    print0(f"profile of step {step}: {path}")
