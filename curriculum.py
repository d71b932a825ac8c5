"""--curriculum: reasoning-gym's tasks get harder as the policy learns them.

After each validation, every reasoning-gym task whose held-out accuracy (val-core/reasoning_gym/NAME/reward/mean@n)
is at least --curriculum-threshold goes up one level of reasoning-gym's own curriculum for it, and its rows, training
and held-out, are replaced by new ones at that level (tasks/reasoning_gym.level_rows), as many as before, from
seeds that follow from the step. The training batches keep their seeded order over the same number of rows. Logged
every step: curriculum/NAME/level, the level the step trained on and validated. A resumed run replays the rule on
the metrics its checkpoint holds, so it makes exactly the same rows and draws the same prompts. The data must
start at a level: `python data_prep.py reasoning-gym --task NAME --level 0`.
"""

from data_prep import render_chats
from tasks.reasoning_gym import PREFIX, decode, is_rgym_source, level_rows, max_level


class Curriculum:
    """Each reasoning-gym task's level; step() raises them and replaces the task's rows in train_rows and val_rows,
    the lists the rollout source reads, in place. With --curriculum off it has no tasks and step() returns {}.
    history: a resumed run's logged metrics (resume)."""

    def __init__(self, args, train_rows, val_rows, tokenizer, history=()):
        self.args, self.train_rows, self.val_rows, self.tokenizer = args, train_rows, val_rows, tokenizer
        self.tasks = {}  # NAME -> {"level", "config", "before"}, from its first training row
        for i, row in enumerate(train_rows if args.curriculum else []):
            name, info = row["data_source"][len(PREFIX) :], row.get("extra_info") or {}
            if not is_rgym_source(row["data_source"]) or name in self.tasks:
                continue
            if not isinstance(info.get("level"), int):
                raise SystemExit(
                    f"--curriculum: {args.train_data}, row {i} ({row['data_source']}) has no curriculum level in "
                    "extra_info.level; write the data at a level: python data_prep.py reasoning-gym --task NAME --level 0"
                )
            before = row["prompt"][:-1]  # the system prompt and worked examples, kept for the new rows
            self.tasks[name] = {"level": info["level"], "config": decode(info["config"]), "before": before}
        if args.curriculum and not self.tasks:
            raise SystemExit(
                f"--curriculum: {args.train_data} has no reasoning-gym rows (data_source reasoning_gym/NAME)"
            )
        self.resume(list(history))

    def resume(self, history):
        """Back to where the run was after its last logged step: the levels logged then, the rule applied to that
        step's metrics again, and each task's rows made again at the step that raised it to its level (the last
        step that logged the level below)."""
        if not self.tasks or not history:
            return
        for name, task in self.tasks.items():
            task["level"] = int(history[-1].get(f"curriculum/{name}/level", task["level"]))
        self.raise_levels(history[-1])
        for name, task in self.tasks.items():
            made = [m["step"] for m in history if m.get(f"curriculum/{name}/level") == task["level"] - 1]
            if made:
                self.replace_rows(name, made[-1])

    def step(self, step, metrics):
        """This step's levels as metrics; after a validation, the tasks at or above the threshold go up a level
        for the next step (their rows replaced now)."""
        out = {f"curriculum/{name}/level": task["level"] for name, task in self.tasks.items()}
        for name in self.raise_levels(metrics):
            self.replace_rows(name, step)
        return out

    def raise_levels(self, metrics):
        """The tasks that go up a level after `metrics`: held-out accuracy >= the threshold, below their top level."""
        changed = []
        for name, task in self.tasks.items():
            accuracy = metrics.get(f"val-core/{PREFIX}{name}/reward/mean@{self.args.val_n}")
            if accuracy is not None and accuracy >= self.args.curriculum_threshold and task["level"] < max_level(name):
                task["level"] += 1
                changed.append(name)
        return changed

    def replace_rows(self, name, step):
        """Task `name`'s rows, in train_rows and val_rows, replaced by as many at its level, made from `step`."""
        task, source = self.tasks[name], PREFIX + name
        places = [
            [i for i, r in enumerate(rows) if r["data_source"] == source] for rows in (self.train_rows, self.val_rows)
        ]
        how = (task["config"], task["before"], (len(places[0]), len(places[1])))
        new = level_rows(name, task["level"], step, self.args.seed, *how)
        for rows, where, made in zip((self.train_rows, self.val_rows), places, new):
            render_chats(made, self.tokenizer)
            too_long = [r for r in made if len(r["prompt_ids"]) > self.args.max_prompt_length]
            if too_long:
                raise SystemExit(
                    f"--curriculum: {name} at level {task['level']} has prompts of {len(too_long[0]['prompt_ids'])} "
                    f"tokens, over --max-prompt-length {self.args.max_prompt_length}; raise it"
                )
            for i, row in zip(where, made):
                rows[i] = row
