"""A command line becomes the run's flags (config.Args): one --flag per field, its docstring as --help, a recipe
(--config FILE, verl's key=value: recipe.py) read under the flags given, the demo's defaults for --model tiny, and
every problem check_args finds refused before anything loads.

    python train_grpo.py --help
"""

import argparse
import ast
import dataclasses
import inspect
import os
import sys
import textwrap

import config
import recipe
from config import DEMO_OVERRIDES, Args, check_args, flag
from translate import RecipeError
from user_errors import record_root_cause


def field_docs(cls):
    """The docstring under each dataclass field, read from the source: they become --help."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        a.target.id: b.value.value
        for a, b in zip(body, body[1:])
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
    }


class Parser(argparse.ArgumentParser):
    """argparse, whose errors are also torchrun's root cause (user_errors.record_root_cause): the
    last line torchrun prints about a failed rank is then the error, not a pointer to its docs."""

    def error(self, message):
        record_root_cause(f"{self.prog}: error: {message}")
        super().error(message)


class Append(argparse.Action):
    """A flag that may be repeated: its values are joined with commas into one string field."""

    def __call__(self, parser, namespace, value, option_string=None):
        before = getattr(namespace, self.dest)
        setattr(namespace, self.dest, f"{before},{value}" if before else value)


def given_flags(argv):
    """The names of the flags on a command line (--no-x gives x)."""
    return {a.split("=")[0].lstrip("-").replace("-", "_").removeprefix("no_") for a in argv if a.startswith("--")}


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    # no abbreviations: --max-st 5 would otherwise be --max-steps 5, then lost to the demo's max_steps.
    # A short usage line, so that an error is not buried under fifty flags.
    parser = Parser(
        usage="%(prog)s [--flag value ...]   (--help lists every flag)",
        description=config.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", default="", help=recipe.HELP)
    docs = field_docs(Args)
    for f in dataclasses.fields(Args):
        name, help_text = flag(f.name), f"{docs[f.name]} (default: {f.default})"
        if f.type is bool:
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif f.name == "reward_fn":
            parser.add_argument(name, action=Append, default=f.default, help=help_text)
        else:
            parser.add_argument(name, type=f.type, default=f.default, choices=f.metadata.get("choices"), help=help_text)
    namespace, extras = parser.parse_known_args(argv)
    recipe_file = vars(namespace).pop("config")  # not a flag the run reads: the file some of its flags came from
    unknown = [a for a in extras if a.startswith("-") or "=" not in a]  # key=value: verl's keys (recipe.py)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    world, given = int(os.environ.get("WORLD_SIZE", 1)), given_flags(argv)  # torchrun sets WORLD_SIZE
    try:  # the recipe's flags, as if typed before the command line's own
        read = recipe.read(recipe_file, extras, {k: getattr(namespace, k) for k in given - {"config"}}, world)
    except RecipeError as e:
        parser.error(str(e))
    for key, value in read.values.items():
        if key not in given:
            setattr(namespace, key, value)
    args, given = Args(**vars(namespace)), given | set(read.values)
    if args.model == "tiny":
        for key, value in DEMO_OVERRIDES.items():
            if key not in given:
                setattr(args, key, value)
        if args.lr_schedule != "cosine" and "min_lr_ratio" not in given:  # the demo's floor is cosine's
            args.min_lr_ratio = 0.0
    if args.grad_checkpointing and "share_prompts" not in given:  # checkpointed layers drop the KV cache
        args.share_prompts = False
    if args.max_staleness and "tis_cap" not in given:  # the decoupled loss's cap
        args.tis_cap = 2.0  # verl's rollout_is_threshold
    try:
        recipe.count_steps(args, read)  # TRL's warmup_ratio and "epoch" strategies: the run's steps, from the data
    except RecipeError as e:
        parser.error(str(e))
    problems = check_args(args, world=world)
    if problems:
        parser.error("\n  ".join(read.annotate(p) for p in problems))
    if os.environ.get("RANK", "0") == "0":  # rank 0 talks
        recipe.print_lines(read)
    return args
