"""Every random generator of this process as plain JSON: Python's, NumPy's, torch's CPU and CUDA ones.

A checkpoint holds one such file per rank (rng_rank{r}.json), so that a resumed run draws the numbers
the uninterrupted run would have drawn; the training loop also puts them back when it abandons a step.
JSON rather than a pickle, because reading a pickle can run code (integrity.py).
"""

import random

import numpy as np
import torch


def get_state():
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(mt), gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_state(state):
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def check_state(state):
    """Raise if `state` cannot be restored. The generators themselves are the best judges of what a
    valid state is, so we try it on them and put ours back."""
    ours = get_state()
    try:
        set_state(state)
    finally:
        set_state(ours)
