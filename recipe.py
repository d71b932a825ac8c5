"""A recipe read into the run's flags before anything loads, for cli.parse_args: `--config FILE` (.yaml, .yml or
.json) holds our flags by name (a run's own config.json too), or TRL's GRPOConfig fields (trl_fields.py), or verl's
keys (verl_keys.py), which also come as key=value arguments on the command line. Our flags on the command line win
over the file; a verl key given again later replaces the earlier one, as in verl's scripts; a verl key and one of
our flags that set one flag to two values are refused. The start-up lines say which file and keys set each flag,
the peer's defaults that were taken, and the keys that change nothing here. Every problem names the key, where it
came from, and what to do.

    torchrun --nproc_per_node=1 train_grpo.py --config recipes/dapo.yaml --lr 5e-4
    torchrun --nproc_per_node=1 train_grpo.py --config config_demo.yaml      # TRL's
    torchrun --nproc_per_node=1 train_grpo.py algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=5 ...
"""

import dataclasses
import json
import math
import os
import textwrap

import trl_fields
import verl_keys
from config import Args, flag
from translate import Ratio, RecipeError, apply_rules, hydra_value, nearest, no_effect, typed

HELP = (
    "A recipe file, .yaml or .json: our flags by name (a run's config.json too), TRL's GRPOConfig fields or verl's keys; "
    "flags on the command line win. verl's keys also come as key=value arguments (docs/from_verl_trl.md)."
)
FIELDS = {f.name: f for f in dataclasses.fields(Args)}
OURS = {f.name: f.default for f in dataclasses.fields(Args)}
NOT_TAKEN = ("out_dir", "resume", "config")  # a run's config.json: a new run has its own (config: an older run's file)
CLI = "the command line"


@dataclasses.dataclass
class Recipe:
    """What the recipe sets: {flag: value} (a Ratio until the data is counted), where each came from
    {flag: "FILE: keys"}, and the start-up lines."""

    values: dict = dataclasses.field(default_factory=dict)
    sources: dict = dataclasses.field(default_factory=dict)
    lines: list = dataclasses.field(default_factory=list)

    def annotate(self, problem):
        """check_args' line about a flag the recipe set, with where it came from."""
        named = [f for f in self.sources if problem.startswith(flag(f) + " ") or f"({flag(f)} " in problem]
        return problem + "".join(f" [{flag(f)}: {self.sources[f]}]" for f in named)


def read(config, overrides, given, world=1, cuda=None):
    """The Recipe of `config` (a path, or "") and the command line's key=value `overrides`, for the command
    line's own flags `given` ({flag: value}): those win over the file, and a verl key on the command line must
    agree with them. Raises RecipeError naming the key and where it came from."""
    recipe, layers = (
        Recipe(),
        {},
    )  # layers[flag] = [(rank, value, source, kind)]: 0 a default, 1 the file, 2 the command line
    keys, where = {}, {}  # verl's keys, in order (a later one replaces), and where each came from
    if config:
        data = load(config)
        skipped = [k for k in NOT_TAKEN if k in data] if os.path.basename(config) == "config.json" else []
        for name in skipped:  # a run's own: a new run has its own
            del data[name]
        if skipped:
            recipe.lines.append(f"recipe: not taken from {config}: {', '.join(skipped)} (a new run has its own)")
        kind = file_kind(config, data)
        if kind == "trl":
            peer(recipe, layers, trl_fields, data, dict.fromkeys(data, config), world, cuda, "TRL 1.16.0")
        else:
            ours = {k: v for k, v in data.items() if k in FIELDS}
            for name, value in ours.items():
                layers.setdefault(name, []).append((1, our_value(name, value, config), f"{config}: {name}", "ours"))
            keys.update({k: v for k, v in data.items() if k not in FIELDS})
            where.update(dict.fromkeys(keys, config))
    for arg in overrides:
        key, _, text = arg.partition("=")
        key = key.lstrip("+")  # Hydra's +key=value (add) and ++key=value (add or replace)
        if key.startswith("~") or not key.startswith(verl_keys.SECTIONS):
            raise RecipeError(key, not_verl(arg))
        keys.pop(key, None)  # a key given again later replaces the earlier one, and moves to the end
        keys[key], where[key] = hydra_value(text), CLI
    if keys:
        peer(recipe, layers, verl_keys, keys, where, world, cuda, "verl 0.9.1")
    merge(recipe, layers, given)
    return recipe


def load(path):
    """A recipe file's mapping: YAML (.yaml, .yml) or JSON (.json), else an error that says what it is not."""
    if "=" in path and not os.path.exists(path):
        raise RecipeError("--config", f"--config {path}: not a file. train_grpo.py's --config is a recipe file "
                          "(.yaml or .json); NAME.key=value is a reasoning-gym task's setting, for `data_prep.py "
                          "reasoning-gym --config`; verl's key=value go on the command line without --config")  # fmt: skip
    if not os.path.isfile(path):
        raise RecipeError("--config", f"--config {path}: no such file")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".yaml", ".yml", ".json"):
        shell = " (a verl script: pass its key=value arguments on our command line instead)" if ext == ".sh" else ""
        raise RecipeError("--config", f"--config {path}: neither YAML (.yaml, .yml) nor JSON (.json){shell}")
    text = open(path, encoding="utf-8").read()
    try:
        if ext == ".json":
            data = json.loads(text)
        else:
            import yaml  # PyYAML, which transformers needs too (requirements.txt pins it)

            data = yaml.safe_load(text)
    except Exception as e:  # yaml.YAMLError, json.JSONDecodeError: the parser's own line and column
        raise RecipeError("--config", f"{path}: not valid {'JSON' if ext == '.json' else 'YAML'} ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError("--config", f"{path}: expected a mapping of keys to values, got a {type(data).__name__}")
    return flatten(data)


def flatten(data, prefix=""):
    """verl's nested sections as dotted keys (actor_rollout_ref: {actor: {optim: {lr: 1e-6}}} ->
    actor_rollout_ref.actor.optim.lr); every other key as it is (TRL's dict fields stay dicts)."""
    out = {}
    for key, value in data.items():
        key = f"{prefix}{key}"
        if isinstance(value, dict) and (prefix or f"{key}.".startswith(verl_keys.SECTIONS)):
            out.update(flatten(value, key + "."))
        else:
            out[key] = value
    return out


def file_kind(path, data):
    """ "trl" when a key is TRL's and not one of our flags, else "ours" (our flags, verl's keys). A key neither
    knows is refused with the nearest; a file of both TRL's fields and ours or verl's is refused."""
    trl = set(trl_fields.KEYS) | set(trl_fields.NO_EFFECT)
    verl = [k for k in data if k.startswith(verl_keys.SECTIONS)]
    trl_only = [k for k in data if k in trl and k not in FIELDS]
    for key in data:
        if key not in FIELDS and key not in trl and key not in verl:
            ours = any(k in FIELDS and k not in trl for k in data) or verl
            known = (
                list(FIELDS) if ours else [k for k in trl if k not in FIELDS] if trl_only else list(FIELDS) + list(trl)
            )
            near = nearest(key, known)
            raise RecipeError(key, f"{path}: {key}: not one of our flags{', nor a TRL field' if not verl else ''}"
                              + (f"; did you mean {near}?" if near else ""))  # fmt: skip
    ours_only = [k for k in data if k in FIELDS and k not in trl]
    if trl_only and (ours_only or verl):
        other, what = (ours_only[0], "our flags") if ours_only else (verl[0], "verl's keys")
        raise RecipeError(trl_only[0], f"{path}: mixes TRL's fields ({trl_only[0]}) and {what} "
                          f"({other}): one file speaks one language; put our flags on the command line")  # fmt: skip
    return "trl" if trl_only else "ours"


def our_value(name, value, where):
    """A value for our flag `name` from a file: its type (a list joins with commas for text flags), its choices and
    its range, checked now, naming the key and the file."""
    f = FIELDS[name]
    if f.type is str and isinstance(value, list):
        value = ",".join(str(v) for v in value)
    try:
        return typed(name, value, f.type)
    except RecipeError as e:
        raise RecipeError(name, f"{where}: {e}") from None


def peer(recipe, layers, table, given, where, world, cuda, who):
    """A peer's keys (`table`: verl_keys or trl_fields) into layers: what they set (the file's rank 1, the command
    line's 2), the peer's defaults that differ from ours (rank 0), the keys with no effect, the defaults refused."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    ignored = dict(table.NO_EFFECT) | (verl_keys.cpu_offload(cuda) if table is verl_keys else {})
    typed_keys = {}
    for key, value in given.items():
        section = next((s for s in getattr(table, "NO_EFFECT_SECTIONS", {}) if key.startswith(s)), None)
        if key not in table.KEYS and key not in ignored and section is None:
            near = nearest(key, list(table.KEYS) + list(ignored))
            raise RecipeError(key, f"{where[key]}: {key}: not a {who} key we know" + (f"; did you mean {near}?" if near else ""))  # fmt: skip
        try:
            typed_keys[key] = typed(key, value, table.KEYS[key][1]) if key in table.KEYS else value
        except RecipeError as e:
            raise RecipeError(key, f"{where[key]}: {e} ({who}'s type)") from None
        if section:
            recipe.lines.append(f"recipe: no effect here: {key} ({table.NO_EFFECT_SECTIONS[section]})")
    try:
        got = apply_rules(table.rules(world, cuda), typed_keys, table.DEFAULTS, OURS)
        notes = no_effect(typed_keys, ignored)
        if table is trl_fields:
            notes += trl_fields.notes({k: typed_keys.get(k, table.DEFAULTS.get(k)) for k in table.DEFAULTS})
    except RecipeError as e:
        raise RecipeError(
            e.key, f"{where.get(e.key, CLI if table is verl_keys else list(where.values())[0])}: {e}"
        ) from None
    for name, (value, keys) in got.set.items():
        rank = 2 if any(where[k] == CLI for k in keys) else 1
        source = "; ".join(
            f"{w}: {', '.join(k for k in keys if where[k] == w)}" for w in dict.fromkeys(where[k] for k in keys)
        )
        layers.setdefault(name, []).append((rank, value, source, "peer"))
    for name, (value, keys) in got.defaults.items():
        layers.setdefault(name, []).append((0, value, f"{who}'s default: {', '.join(keys)}", "default"))
    for name, error in got.refused_defaults.items():
        layers.setdefault(name, []).append((0, error, f"{who}'s default", "refused"))
    by_why = {}
    for key, why in notes:
        by_why.setdefault(why, []).append(key)
    if by_why:
        recipe.lines.append(
            "recipe: no effect here: " + "; ".join(f"{', '.join(k)} ({why})" for why, k in by_why.items())
        )


def merge(recipe, layers, given):
    """Each flag's value from its layers, highest rank first; our flag on the command line above all."""
    taken = {}  # where -> what it set
    for name, options in layers.items():
        options.sort(key=lambda o: -o[0])
        rank, value, source, kind = options[0]
        if name in given:
            clash = [o for o in options if o[0] == 2 and o[1] != given[name]]
            if clash:
                raise RecipeError(name, f"{clash[0][2]} (= {clash[0][1]}) and {flag(name)} {given[name]}, both on the "
                                  f"command line, set {flag(name)} to two values: keep one")  # fmt: skip
            over = [o for o in options if o[0] == 1]
            if over:
                recipe.lines.append(f"recipe: {flag(name)} {given[name]} (the command line) wins over {over[0][2]}")
            continue
        same_rank = [o for o in options if o[0] == rank and o[3] != kind and o[1] != value]
        if same_rank:
            raise RecipeError(name, f"{source} (= {value}) and {same_rank[0][2]} (= {same_rank[0][1]}) set {flag(name)} to two values: keep one")  # fmt: skip
        if kind == "refused":
            raise RecipeError(name, f"{value} ({source}: the recipe leaves it out; set it, or give {flag(name)})")
        if not isinstance(value, Ratio):
            value = check(name, value, source)
        recipe.values[name], recipe.sources[name] = value, source
        where, _, keys = source.partition(": ")
        item = f"{name}={show(value)}" + (f" <- {keys}" if keys != name else "")
        taken.setdefault((-rank, where), []).append(None if kind == "ours" and value == OURS[name] else item)
    for (rank, where), items in sorted(taken.items()):
        what = f"{where}s, for keys the recipe leaves out, where ours differ" if rank == 0 else where
        same = f"; {items.count(None)} more at our defaults" if None in items else ""
        recipe.lines.append(f"recipe: {what}: " + "; ".join(i for i in items if i) + same)


def check(name, value, source):
    """A translated value for our flag: its type, choices and range, naming the keys that set it."""
    f = FIELDS[name]
    try:
        value = typed(name, value, f.type)
    except RecipeError as e:
        raise RecipeError(name, f"{source}: {e}") from None
    choices, ok = f.metadata.get("choices"), f.metadata.get("ok")
    if choices and value not in choices or ok and not ok(value):
        expected = f"one of {', '.join(choices)}" if choices else f.metadata["must_be"]
        left_out = " (the recipe leaves that key out: set it)" if "'s default: " in source else ""
        raise RecipeError(name, f"{source} gives {flag(name)} {value}; it must be {expected}{left_out}")
    return value


def show(value):
    if isinstance(value, Ratio):
        return "an epoch's steps" if value.per_epoch else f"ceil({value.share} x the run's steps)"
    return repr(value)


def not_verl(arg):
    hint = "verl's keys start with " + ", ".join(s.rstrip(".") for s in verl_keys.SECTIONS[:4])
    return (f"{arg}: not one of verl's keys ({hint}, ...). A reasoning-gym task's NAME.key=value goes to `data_prep.py "
            "reasoning-gym --config`; our flags are --flag value")  # fmt: skip


def count_steps(args, recipe):
    """The Ratio values (TRL's warmup_ratio, save_strategy epoch, ...) in steps, now that the flags are known:
    ceil(share x the run's steps), the run's steps being epochs x (rows // prompt_batch_size), at most max_steps
    (the rows before prompts over max_prompt_length are dropped)."""
    from prompt_data import DataError, parquet_files, read_rows, storage

    for name, value in recipe.values.items():
        if not isinstance(value, Ratio):
            continue
        try:
            if storage(args.train_data) == "parquet":
                import pyarrow.parquet as pq

                rows = sum(pq.ParquetFile(f).metadata.num_rows for f in parquet_files(args.train_data))
            else:
                rows = len(read_rows(args.train_data)[0])
        except (DataError, OSError) as e:
            raise RecipeError(
                name, f"{recipe.sources[name]}: needs the training data's rows to count steps ({e})"
            ) from None
        per_epoch = rows // args.prompt_batch_size
        total = min(per_epoch * args.epochs, args.max_steps) if args.max_steps > 0 else per_epoch * args.epochs
        steps = per_epoch if value.per_epoch else math.ceil(value.share * total)
        setattr(args, name, check(name, steps, recipe.sources[name]))
        recipe.lines.append(f"recipe: {name}={steps}: {show(value)}, of {total} steps ({rows} rows)")


def print_lines(recipe, width=120):
    for line in recipe.lines:
        print(textwrap.fill(line, width, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False))
