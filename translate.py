"""A peer's recipe read as our flags: what verl's tables (verl_keys.py) and TRL's (trl_fields.py) share. Each table
is a list of rules, one per flag of ours: the peer's keys it reads, a function of their values (verl's or TRL's
defaults for those left out) and the conversion in words, which the docs and the start-up line quote. A value the
peer writes as text (Hydra's key=value) is read as Hydra reads it, then checked against the key's type; a key no
table knows is refused with the nearest one it does.

    read = apply_rules(RULES, given={"data.train_batch_size": 8}, defaults=DEFAULTS, ours=OUR_DEFAULTS)
"""

import ast
import dataclasses
import difflib
import math
import re
from typing import NamedTuple

SKIP = object()  # a rule's function returns it when the keys leave the flag alone (lora_alpha without LoRA)


class RecipeError(ValueError):
    """A key we cannot read or honour. `key` is the peer's (recipe.py adds where it came from)."""

    def __init__(self, key, message):
        super().__init__(message)
        self.key = key


class Rule(NamedTuple):
    field: str | None  # our flag, or None: a check of the keys that sets nothing
    keys: tuple  # the peer's keys it reads, in the order fn takes them
    how: str  # the conversion, in words
    fn: object  # fn(*values) -> our value, or SKIP; raises RecipeError for a value we cannot honour
    fill: bool = True  # the peer's default applies when the recipe leaves the keys out (False: paths)


class Ratio(NamedTuple):
    """A count of training steps known only once the data is: ceil(share x total steps) (TRL's warmup_ratio),
    or with per_epoch the steps of one epoch (TRL's "epoch" strategies). recipe.py resolves it."""

    share: float
    per_epoch: bool = False


@dataclasses.dataclass
class Read:
    """What a peer's keys set: {flag: (value, the keys that set it)}; the peer's defaults that differ from
    ours, {flag: (value, keys)}; the keys with no effect here, [(key, why)]; and the defaults we cannot honour,
    {flag: RecipeError}, raised only if no flag of ours sets that flag."""

    set: dict = dataclasses.field(default_factory=dict)
    defaults: dict = dataclasses.field(default_factory=dict)
    ignored: list = dataclasses.field(default_factory=list)
    refused_defaults: dict = dataclasses.field(default_factory=dict)


def apply_rules(rules, given, defaults, ours):
    """Each rule's flag from the keys `given` (the recipe's, typed) and the peer's `defaults` for the others. A flag
    whose keys are all left out gets the peer's default only where it differs from `ours` (our flag's default)."""
    read = Read()
    for rule in rules:
        hit = [k for k in rule.keys if k in given]
        if not hit and not rule.fill:
            continue
        try:
            value = rule.fn(*[given.get(k, defaults.get(k)) for k in rule.keys])
        except RecipeError as e:
            if hit:
                raise
            read.refused_defaults[rule.field] = e  # a default we cannot honour: refused unless a flag sets it
            continue
        if value is SKIP or rule.field is None:
            continue
        if hit:
            read.set[rule.field] = (value, hit)
        elif value != ours[rule.field]:
            read.defaults[rule.field] = (value, list(rule.keys))
    return read


def no_effect(given, table):
    """[(key, why)] for the given keys of `table` ({key: (why, ok)}): each has no effect here; ok(value) False
    (a value we cannot honour) raises RecipeError with why."""
    notes = []
    for key, value in given.items():
        if key in table:
            why, ok = table[key]
            if ok is not None and not ok(value):
                raise RecipeError(key, f"{key}={show(value)}: {why}")
            notes.append((key, why))
    return notes


def refuse(key, value, why):
    raise RecipeError(key, f"{key}={show(value)}: {why}")


def show(value):
    """A value as the peer writes it: True, 1e-06, [console, wandb], null."""
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)


def nearest(key, known):
    """The known key closest to a misspelt one: by the whole dotted key, else by its last part."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:
        last = {k.rsplit(".", 1)[-1]: k for k in known}
        close = [last[m] for m in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(last), n=1, cutoff=0.75)]
    return close[0] if close else None


NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?inf|nan")


def hydra_value(text):
    """A key=value's value as Hydra reads it: null, true/false (any case), an int, a float (1e-6 too), a list
    [a,b] (quoted items or not), a quoted string, else the text itself."""
    low = text.strip().lower()
    if low == "null":
        return None
    if low in ("true", "false"):
        return low == "true"
    if re.fullmatch(r"[+-]?\d+", text.strip()):
        return int(text)
    if NUMBER.fullmatch(low):
        return float(text)
    if text.startswith("[") and text.endswith("]"):
        items = re.findall(r"""\s*("[^"]*"|'[^']*'|[^,]+)\s*(?:,|$)""", text[1:-1])
        return [hydra_value(i) for i in items]
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


KINDS = {float: "a number", int: "an integer", bool: "true or false", str: "text", list: "a list", dict: "a mapping"}
TYPES = {"float": float, "int": int, "bool": bool, "str": str, "list": list, "dict": dict, "null": None}


def table(text):
    """A table written as text, one row a line, columns split on " | " (# starts a comment line)."""
    lines = [line for line in text.strip().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [[column.strip() for column in line.split(" | ")] for line in lines]


def key_table(text):
    """{key: (default, type)} from rows `key | default (as Hydra writes it) | type (int, float|null, ...)`."""
    return {key: (hydra_value(default), tuple(TYPES[t] for t in kind.split("|"))) for key, default, kind in table(text)}


def rule_table(text, convert, no_fill=()):
    """[Rule] from rows `our flag | the peer's keys, space-separated | the conversion in words`, each flag's function
    from `convert` (a check that sets nothing is named in parentheses: "(ranks)")."""
    return [
        Rule(None if flag.startswith("(") else flag, tuple(keys.split()), how, convert[flag], flag not in no_fill)
        for flag, keys, how in table(text)
    ]


def accepted(text):
    """{key: (why, ok)} from rows `keys, space-separated | the values we accept (a Python list), or * for any | why
    it changes nothing here`."""
    out = {}
    for keys, values, why in table(text):
        ok = None if values == "*" else (lambda allowed: lambda v: v in allowed)(ast.literal_eval(values))
        out.update({key: (why, ok) for key in keys.split()})
    return out


def typed(key, value, kind):
    """`value` (from a file, or text from a command line) as `kind`: float, int, bool, str, list, or a tuple of
    those (None among them: null is allowed). A number written as text in YAML (1e-6, which YAML 1.1 reads as
    text) is read as a number. Raises RecipeError naming the key and what it expected."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if value is None and None in kinds:
        return None
    if isinstance(value, str) and not {str, list} & set(kinds):
        value = hydra_value(value)
    for k in kinds:
        if k is dict and isinstance(value, dict):
            return value
        if k is bool and isinstance(value, bool):
            return value
        if k is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if k is float and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        if k is str and isinstance(value, str):
            return value
        if k is list and isinstance(value, list):
            return value
    if list in kinds and isinstance(value, str | int | float) and not isinstance(value, bool):
        return [value]  # a list of one, as Hydra's and TRL's parsers take it
    if str in kinds and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)  # experiment_name=7b reads as text
    expected = " or ".join(KINDS[k] if k is not None else "null" for k in kinds)
    raise RecipeError(key, f"{key}={show(value)}: expected {expected}")
