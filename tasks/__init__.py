"""The tasks: one file per task, holding both how its data is written (rows of verl's schema, see
data_prep.py) and how a response to it is scored (reward.compute_score picks the scorer by the
row's data_source), so that adding a task is adding one file.

    digits.py    the demo's synthetic task: copy the first or last digit of a list
    multiply.py  times tables, the real-model example's task
    gsm8k.py     GSM8K: the number after "####"
    math.py      MATH: the last \\boxed{} answer, compared as mathematics by math-verify
                 (in its own process: math_verify_worker.py)
    reasoning_gym.py  reasoning-gym's ~100 procedural tasks, scored by their own verifiers
    common.py    what the data writers share: reading jsonl, writing parquet
"""
