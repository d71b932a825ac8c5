"""The end-of-run health report: is the run learning, converging, stable and fast?

write_report reads a run directory (config.json, metrics.jsonl, samples/) and writes
report/report.md with PNG plots beside it, every item judged healthy / watch / problem against
the band shown next to it (bands.Bands, the same bands as the live warnings). `judge` makes the
checks, one function per section of the report: task effect, convergence, stability, efficiency.

The report is a pure function of the run directory, so `python eval.py report RUN_DIR` gives the
same report for a finished, crashed or still running run. Its live warnings are health.Monitor
replayed over metrics.jsonl: the same lines the run printed.
"""

import glob
import json
import math
import os
import re

import numpy as np

from bands import parse_bands
from health import FIRST_STEP, Monitor, is_late, non_finite, train_reward_near, val_keys


def read_run(run_dir):
    """config.json (may be missing) and metrics.jsonl rows of a run directory."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl here; is it the --out-dir of a train_grpo.py run?")
    lines = [line for line in open(path) if line.strip()]
    rows = []
    for i, line in enumerate(lines, 1):
        try:  # null is a metric that was NaN or infinite (run_log.json_line)
            rows.append({k: math.nan if v is None else v for k, v in json.loads(line).items()})
        except json.JSONDecodeError as e:
            if i < len(lines):
                raise ValueError(f"{path}: line {i} is not JSON ({e})") from None
            print(f"{path}: the last line is incomplete (a run stopped mid-write?); ignored")
    config_path = os.path.join(run_dir, "config.json")
    config = json.load(open(config_path)) if os.path.exists(config_path) else {}
    return config, rows


# ----------------------------------------------------------------------------------------------
# The checks: one function per section; each returns its rows of (check, value, verdict, band)


def judge(rows, config, bands):
    """Every check of the report: a list of (section, check, value, verdict, band), and the live warnings."""
    train = [r for r in rows if "actor/grad_norm" in r]
    if not train:
        raise ValueError("the run has no training steps logged yet")
    total = config.get("max_steps") if config.get("max_steps", -1) > 0 else train[-1]["step"]
    monitor = Monitor(bands, total, config)
    warnings = [w for row in rows for w in monitor.update(row)]
    learn = learned(train, monitor.vals, bands)
    sections = {
        "task effect": task_effect(monitor, train, bands),
        "convergence": convergence(train, config, bands, total, learn),
        "stability": [grad_norm(train, monitor, config, bands)]
        + stability(rows, train, monitor, learn, bands)
        + engine_gap(train, monitor, config),
        "efficiency": efficiency(rows, train, monitor, bands),
    }
    items = [(section, *check) for section, checks in sections.items() for check in checks]
    return items, warnings


def column(train, key):
    """One metric over the training steps, as floats (a step that did not log it is left out)."""
    return np.array([r[key] for r in train if key in r], dtype=float)


def learned(train, vals, b):
    """Did the run learn? Returns (early, late, top, learned): the first and last quarters' mean train reward, the
    best score any sample got, and whether late rose above early to at least b.learned_reward x top while every
    validation metric validated more than once (vals: key -> [(step, value)]) ended above its start. An entropy
    collapse, a sharp entropy drop or steps where every advantage is 0 are a problem only in a run that did not
    learn: in one that did, the policy found the answer (the calculator's entropy fell 97% in the step its
    held-out accuracy reached 1.0)."""
    scores = column(train, "critic/score/mean")
    quarter = max(len(scores) // 4, 1)
    early, late, top = scores[:quarter].mean(), scores[-quarter:].mean(), column(train, "critic/score/max").max()
    held_out = all(series[-1][1] > series[0][1] for series in vals.values() if len(series) > 1)
    return early, late, top, bool(top > 0 and late > early and late >= b.learned_reward * top and held_out)


def max_run(flags):
    """The longest run of True in a sequence."""
    best = run = 0
    for f in flags:
        run = run + 1 if f else 0
        best = max(best, run)
    return best


def task_effect(monitor, train, b):
    """Did validation improve, and does it keep up with the train reward? Per validation metric."""
    out = []
    for key, series in monitor.vals.items():
        out += validation(key, series, train, b)
    if not monitor.vals:
        out.append(("validation", "no validation was logged", "watch", "--test-freq > 0"))
    return out


def at_last_level(key, series, train):
    """With --curriculum, a task's validations at the level of its last one only (a harder level starts lower, so
    the trend is judged within one level), and the words that say so; else the series as it is."""
    name = key.split("/")[2] if key.startswith("val-core/reasoning_gym/") else None
    levels = {r["step"]: r[f"curriculum/{name}/level"] for r in train if f"curriculum/{name}/level" in r}
    if not levels:
        return series, ""
    first = levels[min(levels)]  # step 0's validation, before any step: the first level
    last = levels.get(series[-1][0], first)
    return [(step, v) for step, v in series if levels.get(step, first) == last], f", at curriculum level {last}"


def validation(key, series, train, b):
    """The checks of one validation metric, from its [(step, value)] series."""
    series, level = at_last_level(key, series, train)
    vals = np.array([v for _, v in series])
    first, final, best = vals[0], vals[-1], vals.max()
    best_step = series[int(vals.argmax())][0]
    value = f"{final:.3f} at step {series[-1][0]} (first {first:.3f}, best {best:.3f} at step {best_step}{level})"
    if not math.isnan(b.target):
        out = [(f"final `{key}`", value, "healthy" if final >= b.target else "problem", f">= target {b.target}")]
    else:
        out = [
            (
                f"final `{key}`",
                value,
                "healthy" if final > first else "problem",
                "above its first validation (no target given: --health-bands target=X)",
            )
        ]
    lost = (best - final) / best if best > 0 else 0.0
    falls = max_run(vals[1:] < vals[:-1])
    verdict = "problem" if lost > b.train_val_gap else "watch" if falls >= b.val_falls else "healthy"
    out.append(
        (
            "validation trend",
            f"{lost:.0%} below its best; longest run of falls: {falls}",
            verdict,
            f"final within {b.train_val_gap:.0%} of the best; fewer than {b.val_falls} falls in a row",
        )
    )
    scores = column(train, "critic/score/mean")
    train_final = train_reward_near(train, series[-1][0])
    gap = (train_final - final) / train_final if train_final and train_final >= b.gap_floor else 0.0
    rising = len(scores) >= 4 and scores[-len(scores) // 4 :].mean() > scores[: len(scores) // 4].mean()
    if train_final is None:  # the last validation is the one before training
        verdict, what = "n/a", f"no training step up to step {series[-1][0]}"
    elif gap <= b.train_val_gap:
        verdict, what = "healthy", "no over-fitting"
    elif final < best:
        verdict, what = (
            ("problem", "over-fitting: train reward rose while validation fell from its best")
            if rising
            else ("watch", "gap, but train reward did not rise")
        )
    else:
        verdict, what = "watch", "gap, but validation is at its best"
    value = what if train_final is None else f"train {train_final:.3f} vs validation {final:.3f}: gap {gap:.0%}, {what}"
    band = f"gap <= {b.train_val_gap:.0%} (train sampled at the training temperature, validation as configured)"
    return out + [("train vs validation", value, verdict, band)]


def convergence(train, config, b, total, learn):
    """Policy loss, entropy and KL to the reference; `learn` is learned()'s answer."""
    pg = column(train, "actor/pg_loss")
    out = [
        (
            "policy loss (actor/pg_loss)",
            f"mean {pg.mean():.4g}, final {pg[-1]:.4g}",
            "healthy" if np.isfinite(pg).all() else "problem",
            "finite at every step; GRPO's hovers near 0 because advantages are centred",
        )
    ]
    ent, steps = column(train, "actor/entropy"), np.array([r["step"] for r in train])
    late = ent[np.array([is_late(b, s, total) for s in steps], dtype=bool)]
    value = f"{ent[0]:.3f} -> {ent[len(ent) // 2]:.3f} -> {ent[-1]:.3f} (first, middle, last step)"
    early, late_score, top, ok = learn
    if not np.isfinite(ent).all():
        verdict = "problem"
        value += f"; not finite at {int((~np.isfinite(ent)).sum())} steps"
    elif ent[-1] < b.entropy_min:
        verdict = "watch" if ok else "problem"
        value += f"; collapsed {'after' if ok else 'before'} the task was learned (train reward {early:.3g} -> {late_score:.3g}, best sample score {top:.3g})"
    elif len(late) and late.mean() > b.entropy_max_late:
        verdict = "watch"
    else:
        verdict = "healthy"
    out.append(
        (
            "entropy (actor/entropy)",
            value,
            verdict,
            f"final >= {b.entropy_min} (below: a problem if the run did not learn); late-run mean <= {b.entropy_max_late}",
        )
    )
    kl = column(train, "actor/kl_loss")
    check, band = "KL to the reference (actor/kl_loss)", f"mean and max <= {b.kl_max}"
    if config.get("kl_coef", 1.0) == 0:
        out.append((check, "off (--kl-coef 0)", "n/a", band))
    else:
        verdict = "healthy" if kl.max() <= b.kl_max else "watch" if kl.mean() <= b.kl_max else "problem"
        out.append((check, f"mean {kl.mean():.4g}, max {kl.max():.4g}", verdict, band))
    return out


def grad_norm(train, monitor, config, b):
    """The gradient norm before clipping. Its level is not judged unless --health-bands grad_norm_max sets one: it
    depends on the model, the batch and the loss, and --grad-clip bounds the step (medians in runs that learned:
    the demo 0.47, SmolLM2 1.0-1.9, distillation 5-8). A non-finite norm skipped the update (divergence); a jump
    above b.grad_norm_jump x its recent median is a watch. Returns the report's row."""
    gn = column(train, "actor/grad_norm")
    finite, clip = gn[np.isfinite(gn)], config.get("grad_clip", 1.0)
    over = int((finite > b.grad_norm_max).sum())  # 0 unless the user set grad_norm_max
    jumps = monitor.fired.get("grad_norm_jump", 0)
    skipped = len(gn) - len(finite)
    verdict = "problem" if skipped else "watch" if over or jumps else "healthy"
    parts = [f"not finite at {skipped} of {len(gn)} steps"] if skipped else []
    if len(finite):
        clipped = int((finite > clip).sum())
        parts.append(
            f"median {np.median(finite):.3g}, max {finite.max():.3g}; {clipped} of {len(gn)} steps clipped (above --grad-clip {clip:g}), {jumps} jumps"
        )
    band = f"finite; no jump > {b.grad_norm_jump}x its recent median"
    if math.isfinite(b.grad_norm_max):
        parts.append(f"{over} above {b.grad_norm_max}")
        band += f"; none above {b.grad_norm_max}"
    value = "; ".join(parts)
    return ("grad norm (actor/grad_norm)", value, verdict, band)


def stability(rows, train, monitor, learn, b):
    """Update size, advantages, skipped updates and non-finite metrics; `learn` is learned()'s answer."""
    out = update_size(train, learn[3], b)
    zs = column(train, "frac_reward_zero_std")
    all_zero, tail = int((zs >= 1).sum()), zs[-max(len(zs) // 4, 1) :]
    why = (
        "the task is learned: most groups are all right"
        if learn[3]
        else "too hard, or the policy is stuck: most groups are all wrong or identical"
    )
    verdict = (
        "problem"
        if all_zero > max(len(zs) / 4, 2) and not learn[3]  # a short run's first step or two: often all 0
        else "watch"
        if all_zero or tail.mean() > 0.5
        else "healthy"
    )
    out.append(
        (
            "advantages",
            f"critic/advantages min {column(train, 'critic/advantages/min').min():.3g}, max {column(train, 'critic/advantages/max').max():.3g}; "
            f"zero-std groups {zs.mean():.0%} on average, {tail.mean():.0%} in the last quarter ({why if tail.mean() > 0.5 else 'fine'}); "
            f"steps with every advantage 0: {all_zero}",
            verdict,
            "zero-std groups <= 50% late; every-advantage-0 steps <= 25% (more: a problem if the run did not learn)",
        )
    )
    skipped = int(sum(r.get("actor/skipped_updates", 0) for r in train))
    out.append(("skipped updates (non-finite or runaway)", str(skipped), "healthy" if skipped == 0 else "problem", "0"))
    broken = [(r["step"], non_finite(r)) for r in rows if non_finite(r)]
    value = f"{len(broken)} of {len(rows)} logged rows" + (
        f"; first at step {broken[0][0]}: {', '.join(broken[0][1][:4])}" if broken else ""
    )
    return out + [("non-finite metrics (NaN, inf)", value, "problem" if broken else "healthy", "none")]


def engine_gap(train, monitor, config):
    """The engine's log-probs of the sampled tokens against the trainer's (health.gap_bands), where logged."""
    gaps, probs = column(train, "training/rollout_logprob_diff_max"), column(train, "training/rollout_probs_diff_mean")
    if monitor.gap is None or not len(gaps) or len(gaps) != len(probs):
        return []
    over = int(((gaps > monitor.gap[0]) | (probs > monitor.gap[1])).sum())
    value = f"largest log-prob gap {gaps.max():.3g} nats, probs_diff_mean up to {probs.max():.3g}; {over} of {len(gaps)} steps above"
    band = f"logprob_diff_max <= {monitor.gap[0]:g} and probs_diff_mean <= {monitor.gap[1]:g} in {config.get('dtype', 'fp32')}"
    return [("engine-vs-trainer gap (training/rollout_*)", value, "problem" if over else "healthy", band)]


def update_size(train, learned, b):
    """The largest one-step entropy drop: a large update shows as a sudden fall in entropy. In a run that
    learned it is the policy finding the answer (a watch); in one that did not, the learning rate is too high."""
    ent, steps = column(train, "actor/entropy"), np.array([r["step"] for r in train])
    drops = 1 - ent[1:] / ent[:-1]
    judged = ent[:-1] > b.entropy_min  # below it, entropy is small and its ratios noisy
    worst = int(np.argmax(np.where(judged, drops, -np.inf))) if judged.any() else None
    check = "update size (largest one-step entropy drop)"
    band = f"<= {b.entropy_drop:.0%} (more, in a run that did not learn: the learning rate is too high)"
    if not np.isfinite(ent).all():
        first = int(np.argmin(np.isfinite(ent)))
        value = (
            f"entropy not finite from step {steps[first]} ({ent[first - 1] if first else math.nan:.3g} -> {ent[first]})"
        )
        return [(check, value, "problem", band)]
    if worst is not None:
        value = f"{drops[worst]:.0%} at step {steps[worst + 1]} ({ent[worst]:.3g} -> {ent[worst + 1]:.3g})"
        verdict = "healthy" if drops[worst] <= b.entropy_drop else "watch" if learned else "problem"
        return [(check, value, verdict, band)]
    return []


def efficiency(rows, train, monitor, b):
    """Step time and its spikes, throughput and where a step's time goes, peak memory. A watch at most: a slow
    step is not a failing run, and on a shared machine it is often the other work (steps of 27-292 s in one run)."""
    t = column([r for r in train if not r.get(FIRST_STEP)] or train, "timing_s/step")  # without start-ups
    head, tail_t = t[1 : max(len(t) // 10, 2)], t[-max(len(t) // 10, 1) :]
    slow = tail_t.mean() > b.step_time_jump * np.median(head) if len(head) else False
    spikes = monitor.fired.get("step_time", 0)
    p10, p90 = np.percentile(t, [10, 90])
    testing = sum(r.get("timing_s/testing", 0.0) for r in rows)
    out = [
        (
            "step time (timing_s/step)",
            f"median {np.median(t):.3g} s/it (p10 {p10:.3g}, p90 {p90:.3g}); {t.sum() / 60:.1f} min of steps + {testing / 60:.1f} min validating; {spikes} spikes",
            "watch" if slow or spikes else "healthy",
            f"last 10% of steps < {b.step_time_jump}x the first 10%; no step > {b.step_time_jump}x its recent median",
        )
    ]
    parts = [
        k.removeprefix("timing_s/")
        for k in train[-1]
        if k.startswith("timing_s/") and k not in ("timing_s/step", "timing_s/testing")
    ]
    split = ", ".join(f"{p} {np.median(column(train, 'timing_s/' + p)) / np.median(t):.0%}" for p in parts)
    tok = column(train, "perf/throughput")
    out.append(
        (
            "throughput (perf/throughput)",
            f"median {np.median(tok):.4g} tokens/s per rank; {column(train, 'perf/total_num_tokens').sum():.4g} tokens in all; median step: {split}",
            "healthy",
            "reported, not judged",
        )
    )
    mem = column(train, "perf/max_memory_allocated_gb")
    early = mem[min(10, len(mem) - 1)]
    verdict = "healthy" if mem.max() <= 1.2 * early else "watch"
    return out + [
        (
            "peak memory (perf/max_memory_allocated_gb)",
            f"{mem.max():.3g} GB (at step 10: {early:.3g} GB)",
            verdict,
            "grows < 20% after step 10 (more: a leak, or longer responses)",
        )
    ]


# ----------------------------------------------------------------------------------------------
# Plots, samples and the markdown file


PLOTS = {  # file -> (title, metric keys, band attribute or None, log scale)
    "reward.png": ("reward", ["critic/score/mean", "val-core"], "target", False),
    "kl.png": ("KL", ["actor/kl_loss", "actor/ppo_kl"], "kl_max", False),
    "entropy.png": ("entropy (nats/token)", ["actor/entropy"], "entropy_min", False),
    "grad_norm.png": ("grad norm (before clipping)", ["actor/grad_norm"], "grad_norm_max", True),
    "response_length.png": (
        "response length (tokens)",
        ["response_length/mean", "response_length/max", "response_length/min"],
        None,
        False,
    ),
    "step_time.png": (
        "step time (s)",
        ["timing_s/step", "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights"],
        None,
        False,
    ),
}


def plot(rows, bands, out_dir):
    """The curves people otherwise open wandb for, one PNG each; returns the file names."""
    from matplotlib.figure import Figure  # not pyplot: no GUI backend, no global figures to close

    written = []
    for name, (title, keys, band, log) in PLOTS.items():
        fig = Figure(figsize=(6, 3.2), dpi=100)
        ax = fig.add_subplot()
        for key in keys:
            for k in sorted({k for r in rows for k in val_keys(r)}) if key == "val-core" else [key]:
                pts = [(r["step"], r[k]) for r in rows if k in r and math.isfinite(r[k])]
                if pts:
                    ax.plot(
                        *zip(*pts), marker="o" if k.startswith("val-") else None, markersize=3, label=k, linewidth=1.2
                    )
        level = getattr(bands, band) if band else None
        if level is not None and math.isfinite(level):
            ax.axhline(level, color="red", linestyle="--", linewidth=0.8, label=f"band: {band} {level:g}")
        if log:
            ax.set_yscale("log")
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.subplots_adjust(left=0.12, right=0.97, bottom=0.15, top=0.9)  # fixed: tight_layout doubled the time
        fig.savefig(os.path.join(out_dir, name))
        written.append(name)
    return written


def samples_extremes(run_dir, k=3):
    """The best and worst scored samples of the last validation that wrote samples."""
    files = glob.glob(os.path.join(run_dir, "samples", "val_step_*.jsonl"))
    if not files:
        return None, []
    last = max(files, key=lambda p: int(re.search(r"val_step_(\d+)", p).group(1)))
    samples = [json.loads(line) for line in open(last) if line.strip()]
    ranked = sorted(samples, key=lambda s: -s["score"])
    return os.path.relpath(last, run_dir), ranked[:k] + ranked[-k:] if len(ranked) > 2 * k else ranked


def write_report(run_dir, bands=None):
    """Write RUN_DIR/report/report.md and its plots; returns (path, counts of each verdict)."""
    config, rows = read_run(run_dir)
    bands = bands or parse_bands(config.get("health_bands", ""))
    items, warnings = judge(rows, config, bands)
    out_dir = os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    try:
        plots = plot(rows, bands, out_dir)
    except ImportError:
        plots = []
        print("matplotlib is not installed: the report has no plots (pip install -r requirements.txt)")
    counts = {v: sum(1 for it in items if it[3] == v) for v in ("problem", "watch", "healthy")}
    overall = "problem" if counts["problem"] else "watch" if counts["watch"] else "healthy"
    icon = {"healthy": "healthy", "watch": "**watch**", "problem": "**PROBLEM**", "n/a": "n/a"}
    last = max(r["step"] for r in rows)
    max_steps = config.get("max_steps", -1)  # -1: the run's length was set by --epochs
    planned = f"of {max_steps}" if max_steps > 0 else f"({config.get('epochs', '?')} epochs planned)"
    lines = [
        f"# Run health: {os.path.basename(os.path.abspath(run_dir))}",
        "",
        f"Overall: **{overall}** ({counts['problem']} problem, {counts['watch']} watch, {counts['healthy']} healthy) "
        f"after {last} steps {planned}; model `{config.get('model', '?')}`, lr {config.get('lr', '?')}.",
        "Regenerate with `python eval.py report RUN_DIR [--bands name=value,...]`.",
    ]
    for section in ("task effect", "convergence", "stability", "efficiency"):
        lines += [
            "",
            f"## {section.capitalize()}",
            "",
            "| check | value | verdict | healthy band |",
            "| --- | --- | --- | --- |",
        ]
        lines += [f"| {c} | {v} | {icon[verdict]} | {band} |" for s, c, v, verdict, band in items if s == section]
    lines += ["", f"## Live warnings ({len(warnings)})", ""]
    lines += [f"- {w}" for w in warnings[:30]] or ["none"]
    if len(warnings) > 30:
        lines.append(f"- ... and {len(warnings) - 30} more (replay them: `health.Monitor` over metrics.jsonl)")
    source, samples = samples_extremes(run_dir)
    if samples:
        lines += [
            "",
            f"## Best and worst samples ({source})",
            "",
            "| score | prompt | response | ground truth |",
            "| ---: | --- | --- | --- |",
        ]
        cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")[-200:]  # noqa: E731
        lines += [
            f"| {s['score']:.3g} | {cell(s['prompt'])} | {cell(s['response'])} | {cell(s['ground_truth'])} |"
            for s in samples
        ]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p[:-4]}]({p})" for p in plots]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path, dict(counts, overall=overall)
