"""console.py: which third-party messages stay off the console (each by its origin and how it starts), that
every other warning still shows, that --verbose keeps them all, and the config's console line. The demo's
whole console is pinned end to end in test_train_grpo.py (test_the_console_tells_the_runs_story)."""

import dataclasses
import logging
import re
import warnings

import pytest

import console
from config import Args


@pytest.fixture
def quieted(request):
    """console.quiet(verbose) for one test, from a process where it never ran (an earlier test in this worker may
    have run train_grpo's or eval's main, which call it): its logger filters and warning filters are undone after."""
    loggers = {s.origin: logging.getLogger(s.origin) for s in console.VLLM_LOGS}
    before = {name: list(logger.filters) for name, logger in loggers.items()}
    for logger in loggers.values():
        logger.filters[:] = [f for f in logger.filters if not isinstance(f, console.DropKnown)]
    ours = {re.escape(s.origin) + r"\Z" for s in console.PYTHON_WARNINGS}
    with warnings.catch_warnings():
        warnings.filters[:] = [f for f in warnings.filters if getattr(f[3], "pattern", None) not in ours]
        warnings.simplefilter("always")  # what is not silenced is seen every time
        console.quiet(request.param)
        yield loggers
    for name, logger in loggers.items():
        logger.filters[:] = before[name]
    from transformers.utils.logging import enable_progress_bar

    enable_progress_bar()


def passes(logger, msg, *args):
    """Whether a WARNING record with this message gets past `logger`'s filters."""
    return bool(logger.filter(logger.makeRecord(logger.name, logging.WARNING, __file__, 1, msg, args, None)))


@pytest.mark.parametrize("quieted", [False], indirect=True)
def test_each_known_vllm_message_is_dropped_at_its_origin_only(quieted):
    for s in console.VLLM_LOGS:
        assert not passes(quieted[s.origin], s.start + " and the rest of the message"), s
        assert passes(quieted[s.origin], "a warning the user can act on"), s.origin  # the same logger, another message
        assert passes(logging.getLogger("vllm.some.other.module"), s.start), s  # the same message, another logger
    # vLLM's records carry the format string and its arguments: the LD_PRELOAD hint for each library
    cpu_worker = quieted["vllm.v1.worker.cpu_worker"]
    assert not passes(cpu_worker, "%s is not found in LD_PRELOAD. For best performance ...", "libtcmalloc")


def warned(message, category, module):
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit(message, category, "somewhere.py", 1, module=module)
    return [str(w.message) for w in seen]


@pytest.mark.parametrize("quieted", [False], indirect=True)
def test_each_known_python_warning_is_ignored_from_its_module_only(quieted):
    reduce_op = "`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead"
    assert warned(reduce_op, FutureWarning, "vllm.triton_utils.dispatcher") == []
    assert warned(reduce_op, FutureWarning, "my_script") == [reduce_op]  # a user's own use of it still warns
    view = "FSDP2-wrapped module (FSDPLlamaForCausalLM) returned a view tensor. An in-place op on this view ..."
    fsdp = "torch.distributed.fsdp._fully_shard._fsdp_state"
    assert warned(view, UserWarning, fsdp) == []
    assert warned("FSDP2 something else", UserWarning, fsdp) == ["FSDP2 something else"]
    assert warned(view, UserWarning, fsdp + "_not") == [view]


@pytest.mark.parametrize("quieted", [True], indirect=True)
def test_verbose_silences_nothing(quieted):
    for s in console.VLLM_LOGS:
        assert passes(quieted[s.origin], s.start), s
    for s in console.PYTHON_WARNINGS:
        assert warned(s.start + "...", s.category, s.origin) == [s.start + "..."]


def test_every_silenced_message_says_why_it_is_safe():
    for s in console.VLLM_LOGS + console.PYTHON_WARNINGS:
        assert s.origin.startswith(("vllm.", "torch.")) and len(s.start) >= 15 and len(s.why) >= 40, s
    assert all(s.category for s in console.PYTHON_WARNINGS)


def test_the_config_line_shows_what_differs_from_the_defaults_and_where_the_rest_is():
    defaults = dataclasses.asdict(Args())
    config = dict(defaults, lr=5e-4, model="/runs/x/tiny_model", train_data="/runs/x/data/train.parquet")
    line = console.config_line(config, defaults, "/runs/x/config.json")
    assert line.startswith("config: model=/runs/x/tiny_model train_data=/runs/x/data/train.parquet lr=0.0005")
    assert " ".join(line.split()).endswith("; the other flags have their defaults (all of them: /runs/x/config.json)")
    assert "kl_coef" not in line and all(len(row) <= 120 for row in line.splitlines())
    assert (
        console.config_line(defaults, defaults, "c.json") == "config: every flag has its default (all of them: c.json)"
    )
