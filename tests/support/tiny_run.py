"""The flags of a tiny loop-train run on the built-in vault, which trains an iteration in a fraction of a second on a
CPU: what the tests of a whole run (tests/unit/training/test_output_dir.py), the refusals of broken task lists
(tests/unit/envs/test_env_contract.py) and ``benchmarks/ctrl_c.py`` start."""

from __future__ import annotations

TINY_VAULT_RUN = [
    "--model_name_or_path",
    "tiny:vault",
    "--environment_kwargs",
    '{"num_tasks": 8}',
    "--tasks_per_iteration",
    "2",
    "--rollouts_per_task",
    "2",
    "--max_turns",
    "2",
    "--max_new_tokens_per_turn",
    "3",
    "--max_trajectory_tokens",
    "128",
    "--minibatch_size",
    "4",
    "--per_device_train_batch_size",
    "4",
    "--learning_rate",
    "0.0006",
    "--activation_checkpointing",
    "false",
    "--disable_tqdm",
    "true",
]
