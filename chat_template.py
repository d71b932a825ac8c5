"""A chat template is code from the model directory: each of its renders is bounded in time.

transformers runs the template in Jinja's sandbox, which keeps it from Python's internals and the
files, but not from looping: two nested {% for %} over range(100000) are 10^10 steps, hours of a run
that hangs saying nothing. bound_chat_template makes every later render of a tokenizer stop past
CHAT_TEMPLATE_SECONDS with a ChatTemplateError naming the template's file. data_prep.load_prompts
bounds the policy's tokenizer, reward_model.load_reward_model its own.
"""

import functools
import os
import signal
import threading
import time
import warnings


class ChatTemplateError(ValueError):
    """A chat template that rendered past CHAT_TEMPLATE_SECONDS; the message names its file."""


# Qwen2.5's template renders a conversation in 0.2 ms (2,048 of them in one call in 0.4 s, on a 2-core
# CPU), so this is far beyond an honest template, even in the reward model's one call for a rank's batch.
CHAT_TEMPLATE_SECONDS = 30


def bound_chat_template(tokenizer):
    """From now on, tokenizer.apply_chat_template raises a ChatTemplateError naming the template's file and the
    limit when one call renders for more than CHAT_TEMPLATE_SECONDS, for every caller (data_prep's prompts,
    tools.py's renders and token deltas, the reward model's conversations). Returns the tokenizer.

    Bounded: renders on the main thread, which are all of ours (a SIGALRM interrupts the Python that
    Jinja compiled the template to; the timer and handler in place before are restored after).
    Not bounded: a render on another thread, where signals cannot reach (it warns, then renders);
    and a single C call that is slow, which no template we know makes (memory is not bounded either)."""
    if not isinstance(vars(tokenizer).get("apply_chat_template"), functools.partial):  # not bounded yet
        tokenizer.apply_chat_template = functools.partial(bounded_render, tokenizer, chat_template_source(tokenizer))
    return tokenizer


def chat_template_source(tokenizer):
    """Where the tokenizer's chat template comes from, for messages: the model directory's
    chat_template.jinja (where transformers 5 saves it), or its tokenizer_config.json's "chat_template"."""
    folder = tokenizer.name_or_path
    if os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        return os.path.join(folder, "chat_template.jinja")
    if os.path.isdir(folder):
        return f'{os.path.join(folder, "tokenizer_config.json")}\'s "chat_template"'
    return f'the chat template of {folder!r} (its chat_template.jinja or tokenizer_config.json\'s "chat_template")'


def bounded_render(tokenizer, source, *args, **kwargs):
    """The tokenizer class's own apply_chat_template(*args, **kwargs), stopped with a ChatTemplateError naming
    `source` after CHAT_TEMPLATE_SECONDS (bound_chat_template)."""
    render = type(tokenizer).apply_chat_template
    if threading.current_thread() is not threading.main_thread():  # signal handlers run on the main thread only
        warnings.warn(f"{source}: a chat template rendered off the main thread is not bounded in time", stacklevel=2)
        return render(tokenizer, *args, **kwargs)
    handler = signal.signal(signal.SIGALRM, functools.partial(template_timed_out, source))
    before, interval = signal.setitimer(signal.ITIMER_REAL, CHAT_TEMPLATE_SECONDS)
    start = time.monotonic()
    try:
        return render(tokenizer, *args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        if before:  # a timer was running: it gets what it had left (fires at once if that ran out meanwhile)
            signal.setitimer(signal.ITIMER_REAL, max(before - (time.monotonic() - start), 1e-6), interval)


def template_timed_out(source, signum, frame):
    raise ChatTemplateError(
        f"{source}: the chat template rendered for more than {CHAT_TEMPLATE_SECONDS} s and was stopped (a chat "
        "template renders in milliseconds: does it loop?). It is code from the model directory: fix it, or replace "
        "it with the template of the model this one was fine-tuned from (the limit: chat_template.CHAT_TEMPLATE_SECONDS)"
    )
