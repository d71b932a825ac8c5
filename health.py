"""Run health while training: a healthy band for each signal, and one-line warnings as signals leave it.

Most of the time spent with an RL run goes into judging it: is the reward rising, is the policy
collapsing, is it over-fitting, is it getting slower? Practitioners check a known list of signals
by hand in wandb. Here each signal has a healthy band (`bands.Bands`, overridable with
`--health-bands name=value,...`), and `Monitor` reads each row train_grpo.py logs and returns a
warning when a signal leaves its band (once; the same warning repeats only after `quiet` healthy
steps). train_grpo.py prints them as they happen.

The end-of-run report (report.py) judges the whole run against the same bands, and lists these
warnings by replaying the Monitor over metrics.jsonl.
"""

import math
import re

import numpy as np

FIRST_STEP = "perf/first_step_after_start"  # marks each process's first step: its time includes the start-up


def gap_bands(bands, config):
    """The engine-vs-trainer gap's bands for a run's config (train_grpo's flags, as config.json holds
    them): (logprob_diff_max, probs_diff_mean) in its dtype; None where the gap is more than the engine's
    error: --max-staleness (the updates since the samples were drawn), --top-k / --top-p (the engine's
    log-probs are over the kept tokens), --lora-dropout (the trainer's are under dropout)."""
    c = {"max_staleness": 0, "top_k": -1, "top_p": 1.0, "lora_dropout": 0.0, **config}
    if c["max_staleness"] or c["top_k"] != -1 or c["top_p"] != 1 or c["lora_dropout"]:
        return None
    if c.get("dtype") == "bf16":
        return bands.logprob_gap_bf16, bands.probs_gap_bf16
    return bands.logprob_gap_fp32, bands.probs_gap_fp32


def is_late(bands, step, total_steps):
    """Whether `step` is late in training: past bands.late of the run, in a run of at least bands.late_min_steps
    steps. A shorter run has no late part: 3 steps say nothing about where the entropy is heading."""
    return total_steps >= bands.late_min_steps and step > bands.late * total_steps


def val_keys(row):
    """The headline validation metrics in a row: val-core/<data_source>/reward/mean@n."""
    return [k for k in row if re.fullmatch(r"val-core/.+/reward/mean@\d+", k)]


# ----------------------------------------------------------------------------------------------
# Live warnings


class Monitor:
    """Feed it every logged row, in order; it returns the warnings that row raises."""

    def __init__(self, bands, total_steps, config=None):
        self.bands, self.total_steps = bands, total_steps
        self.gap = gap_bands(bands, config or {})  # config: the run's flags (dtype and what the gap means)
        self.train = []  # training rows so far
        self.vals = {}  # val key -> [(step, value)]
        self.last_seen = {}  # signal -> the last step it was out of band
        self.fired = {}  # signal -> how many warnings it raised

    def update(self, row):
        found = list(self._check_train(row)) if "actor/grad_norm" in row else []
        found += self._check_val(row)
        step, out = row["step"], []
        for signal, message in found:
            last = self.last_seen.get(signal)
            if last is None or step - last > self.bands.quiet:
                out.append(f"step {step}: {message}")
                self.fired[signal] = self.fired.get(signal, 0) + 1
            self.last_seen[signal] = step
        return out

    def _check_train(self, row):
        b, step = self.bands, row["step"]
        recent = self.train[-20:]
        self.train.append(row)
        gn, kl, ent = row["actor/grad_norm"], row["actor/kl_loss"], row["actor/entropy"]
        broken = [k for k in non_finite(row) if k != "actor/grad_norm"]  # a non-finite grad_norm has its own line
        if broken:
            yield (
                "non_finite",
                f"{', '.join(broken[:4])}{' ...' if len(broken) > 4 else ''} not finite: the run has diverged",
            )
        if not math.isfinite(gn):
            yield "grad_norm", f"actor/grad_norm is {gn}: the update was skipped"
        elif gn > b.grad_norm_max:  # off by default (bands.Bands says why)
            yield "grad_norm", f"actor/grad_norm {gn:.3g} > {b.grad_norm_max} (--health-bands grad_norm_max)"
        past = [r["actor/grad_norm"] for r in recent if math.isfinite(r["actor/grad_norm"])]
        if len(past) >= 5 and np.median(past) > 0 and gn > b.grad_norm_jump * np.median(past):
            yield (
                "grad_norm_jump",
                f"actor/grad_norm {gn:.3g} jumped {gn / np.median(past):.0f}x its recent median {np.median(past):.3g} (band: < {b.grad_norm_jump}x)",
            )
        if kl > b.kl_max:
            yield (
                "kl",
                f"actor/kl_loss {kl:.3g} > {b.kl_max}: the policy is drifting from the reference; raise --kl-coef or lower --lr",
            )
        prev = recent[-1]["actor/entropy"] if recent else None
        if prev is not None and prev > b.entropy_min and ent < (1 - b.entropy_drop) * prev:
            yield (
                "entropy_drop",
                f"actor/entropy fell {1 - ent / prev:.0%} in one step ({prev:.3g} -> {ent:.3g}): unless the reward rises with it, the learning rate is too high",
            )
        if ent < b.entropy_min:
            yield (
                "entropy_low",
                f"actor/entropy {ent:.3g} < {b.entropy_min}: the policy is nearly deterministic and exploration is ending",
            )
        if ent > b.entropy_max_late and is_late(b, step, self.total_steps):
            yield (
                "entropy_high",
                f"actor/entropy {ent:.3g} > {b.entropy_max_late} late in training (step {step} of {self.total_steps}): the policy is not sharpening",
            )
        yield from distill_warnings(b, [r["distill/reverse_kl/mean"] for r in self.train if "distill/reverse_kl/mean" in r],
                                    late=is_late(b, step, self.total_steps))  # fmt: skip
        if row["frac_reward_zero_std"] >= 1.0 and "distill/reverse_kl/mean" not in row:  # a teacher still trains
            yield (
                "zero_adv",
                f"every group's rewards are equal (mean score {row['critic/score/mean']:.3g}): all advantages are 0 and this step cannot learn",
            )
        logprob_gap, probs_gap = (
            row.get("training/rollout_logprob_diff_max"),
            row.get("training/rollout_probs_diff_mean"),
        )
        if self.gap and logprob_gap is not None and (logprob_gap > self.gap[0] or probs_gap > self.gap[1]):
            yield (
                "engine_gap",
                f"the engine's log-probs are not the policy's: training/rollout_logprob_diff_max {logprob_gap:.3g} nats, "
                f"rollout_probs_diff_mean {probs_gap:.3g} (band: <= {self.gap[0]:g} and <= {self.gap[1]:g}): the loss "
                "trains on a wrong behaviour policy; check the weight sync and --tensor-parallel-size",
            )
        times = [r["timing_s/step"] for r in recent if not r.get(FIRST_STEP)]
        if len(times) >= 5 and not row.get(FIRST_STEP) and row["timing_s/step"] > b.step_time_jump * np.median(times):
            yield (
                "step_time",
                f"timing_s/step {row['timing_s/step']:.3g} s is {row['timing_s/step'] / np.median(times):.1f}x its recent median {np.median(times):.3g} s (band: < {b.step_time_jump}x)",
            )

    def _check_val(self, row):
        b, out = self.bands, []
        for key in val_keys(row):
            series = self.vals.setdefault(key, [])
            series.append((row["step"], row[key]))
            values = [v for _, v in series[-(b.val_falls + 1) :]]
            if len(values) == b.val_falls + 1 and all(x > y for x, y in zip(values, values[1:])):
                out.append(
                    (
                        f"val_falls {key}",
                        f"{key} fell {b.val_falls} validations in a row: " + " > ".join(f"{v:.3g}" for v in values),
                    )
                )
            train = train_reward_near(self.train, row["step"])
            if train is not None and train >= b.gap_floor and (train - row[key]) / train > b.train_val_gap:
                out.append(
                    (
                        f"gap {key}",
                        f"train reward {train:.3g} is {(train - row[key]) / train:.0%} above {key} {row[key]:.3g} (band: < {b.train_val_gap:.0%}): over-fitting?",
                    )
                )
        return out


def non_finite(row):
    """The metrics of a logged row that are NaN or infinite (metrics.jsonl stores them as null)."""
    return [k for k, v in row.items() if v is None or (isinstance(v, float) and not math.isfinite(v))]


def train_reward_near(train_rows, step, window=10):
    """Mean training reward (critic/score/mean) over the last `window` steps up to `step`."""
    scores = [r["critic/score/mean"] for r in train_rows if step - window < r["step"] <= step]
    return float(np.mean(scores)) if scores else None


def distill_warnings(b, kl, late, window=5):
    """--teacher's reverse KL, distill/reverse_kl/mean at every step so far (`kl`): it should fall. A warning
    when its mean over the last `window` steps is above b.distill_kl_rise x its lowest such mean so far, or,
    `late` in training, not b.distill_kl_fall below its first `window` steps' mean."""
    if len(kl) < 2 * window:
        return
    means = [float(np.mean(kl[i : i + window])) for i in range(len(kl) - window + 1)]
    now, lowest, first = means[-1], min(means), means[0]
    if lowest > 0 and now > b.distill_kl_rise * lowest:
        yield (
            "distill_kl_rise",
            f"distill/reverse_kl/mean {now:.3g} (last {window} steps) is {now / lowest:.1f}x its lowest {lowest:.3g} "
            f"(band: < {b.distill_kl_rise}x): the student is moving away from the teacher; lower --lr",
        )
    elif late and now > (1 - b.distill_kl_fall) * first:
        yield (
            "distill_kl_flat",
            f"distill/reverse_kl/mean {now:.3g} (last {window} steps) is not {b.distill_kl_fall:.0%} below its first "
            f"{window} steps' {first:.3g} late in training: the student is not learning from the teacher; raise "
            "--distill-coef or --lr, or check that the teacher is better at this task",
        )
