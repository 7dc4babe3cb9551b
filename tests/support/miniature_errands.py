"""The long-horizon recipe (``recipes/errands.yaml``) in miniature, for the benchmarks' end-to-end tests: two
level-1 tasks, a 3-step warm-up, two iterations of 2 x 2 rollouts."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def miniature_recipe(folder: Path) -> Path:
    recipe = yaml.safe_load((ROOT / "recipes" / "errands.yaml").read_text())
    recipe.update(
        environment_kwargs={"num_tasks": 2, "levels": [1]},
        tiny_instruct_steps=3,
        iterations=2,
        tasks_per_iteration=2,
        rollouts_per_task=2,
        minibatch_size=4,
        eval_every=0,
        memory_stress_test=False,
    )
    recipe.pop("eval_split", None)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path
