"""The healthy band of each signal a run is judged by (health.py's live warnings, report.py's end-of-run
report), and --health-bands' parser: "kl_max=0.05,target=0.9" overrides two of them. Below config.py,
which refuses a misspelt band before anything loads."""

import dataclasses


@dataclasses.dataclass
class Bands:
    val_falls: int = 3
    """Warn when validation reward has fallen this many validations in a row."""
    train_val_gap: float = 0.2
    """Warn when train reward exceeds validation reward by more than this fraction of the train reward."""
    gap_floor: float = 0.05
    """Judge the train/val gap only once the train reward is at least this (near 0 it is noise)."""
    kl_max: float = 0.03
    """actor/kl_loss above this: the policy is drifting away from the reference."""
    grad_norm_max: float = float("inf")
    """actor/grad_norm (before clipping) above this: a live warning and a watch. Off (inf) by default: the level
    depends on the model, the batch and the loss, and --grad-clip bounds the step whatever it is (medians of runs
    that learned: the demo 0.47, SmolLM2 1.0-1.9, distillation 5-8). Set it to a level you know for your model."""
    grad_norm_jump: float = 5.0
    """actor/grad_norm above this multiple of its median over the previous 20 steps."""
    entropy_min: float = 0.1
    """actor/entropy (nats per token) below this: the policy is nearly deterministic, exploration ends."""
    entropy_drop: float = 0.5
    """actor/entropy falling by more than this fraction in one step: the update was too large."""
    entropy_max_late: float = 1.0
    """actor/entropy above this late in training: the policy is not sharpening."""
    late: float = 0.5
    """Where "late in training" starts, as a fraction of the total steps."""
    late_min_steps: int = 20
    """A run of fewer steps has no "late in training": its entropy has had no time to fall (SmolLM2's was 1.5-2.2
    after 3 or 4 steps that raised the reward, the demo's 2.6 after 12 of the 100 it needs)."""
    learned_reward: float = 0.5
    """The run learned when its last quarter's train reward rose above its first quarter's to at least this fraction
    of the best sample score, and held-out reward ended above its start. In such a run an entropy collapse, a sharp
    entropy drop and steps where every advantage is 0 are a watch (the policy found the answer), else a problem."""
    step_time_jump: float = 3.0
    """timing_s/step above this multiple of its median over the previous 20 steps."""
    logprob_gap_fp32: float = 1e-2
    """training/rollout_logprob_diff_max (nats) above this in an fp32 run: the engine's log-probs are not
    the policy's (normal: below 1e-4, docs/precision.md)."""
    logprob_gap_bf16: float = 1.0
    """The same in a bf16 run, where its rounding alone reaches 0.6 (SmolLM2)."""
    probs_gap_fp32: float = 1e-4
    """training/rollout_probs_diff_mean above this in an fp32 run (normal: about 5e-6)."""
    probs_gap_bf16: float = 0.02
    """The same in a bf16 run (normal: up to 8.3e-3, SmolLM2)."""
    distill_kl_rise: float = 1.5
    """distill/reverse_kl/mean (--teacher), its mean over the last 5 steps, above this multiple of its lowest such
    mean so far: the student is moving away from the teacher."""
    distill_kl_fall: float = 0.1
    """Late in training distill/reverse_kl/mean's last 5 steps should be at least this fraction below its first 5:
    else the reverse KL is not falling and the student is not learning from the teacher."""
    quiet: int = 20
    """Steps a signal must stay healthy before the same warning is printed again."""
    target: float = float("nan")
    """Validation reward the run should reach (the report judges against it; nan: no target)."""


def parse_bands(text):
    """'kl_max=0.05,target=0.9' -> Bands; unknown names and bad values are errors that list the choices."""
    bands, fields = Bands(), {f.name: f.type for f in dataclasses.fields(Bands)}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        name, _, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if name not in fields or not value:
            raise ValueError(f"{item!r}: expected name=value with name one of {', '.join(fields)}")
        try:
            setattr(bands, name, (int if fields[name] in (int, "int") else float)(value))
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number") from None
    return bands
