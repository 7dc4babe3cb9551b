"""Train on a running OpenEnv environment with LOOP: `from_openenv(client, tasks=...)` is the whole adapter.

Each episode opens its own WebSocket session on the server (reset with the task's seed, then one
step per tool call); the server's rewards are summed into the episode's reward (docs/environments.md,
"verifiers and OpenEnv environments"). Start the server first, allowing as many sessions as run at once, e.g.
`create_app(MyEnv, MyAction, MyObservation, max_concurrent_envs=16)` with
`SUPPORTS_CONCURRENT_SESSIONS = True` on the environment, served on 127.0.0.1:8000. Then:

    python examples/openenv_env.py --base_url http://127.0.0.1:8000 --model Qwen/Qwen2.5-0.5B-Instruct

`GenericEnvClient` needs no environment package: the tool's parameters come from the server's
/schema. With the environment's own client (`from my_env import MyEnv`), pass `MyEnv` instead, and
the tool is built from its typed Action. Needs `pip install 'loop-trainer[openenv]'`.
"""

import argparse

from openenv.core import GenericEnvClient
from peft import LoraConfig

from loop_trainer import LOOPConfig, LOOPTrainer
from loop_trainer.compat.openenv.environment import from_openenv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base_url", default="http://127.0.0.1:8000", help="a running OpenEnv server")
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--output_dir", default="openenv-LOOP")
    parser.add_argument("--tasks", type=int, default=64, help="training seeds 0..N-1 (reset(seed=...))")
    parser.add_argument("--sessions", type=int, default=16, help="at most the server's max_concurrent_envs")
    parser.add_argument("--instructions", default="Play the game: act by calling the tool until it is over.")
    cli = parser.parse_args()
    env = from_openenv(
        GenericEnvClient,
        base_url=cli.base_url,
        tasks=cli.tasks,
        eval_tasks=16,
        instructions=cli.instructions,
        max_concurrent_episodes=cli.sessions,
    )
    args = LOOPConfig(
        output_dir=cli.output_dir,
        iterations=20,
        tasks_per_iteration=8,
        rollouts_per_task=6,
        minibatch_size=12,
        max_turns=8,
        max_new_tokens_per_turn=256,
        max_trajectory_tokens=4096,
        learning_rate=1e-5,
        eval_split="eval",
        eval_every=5,
        report_to=[],
    )
    try:
        trainer = LOOPTrainer(cli.model, env, args, peft_config=LoraConfig(r=16, target_modules="all-linear"))
        trainer.train()
        trainer.save_model()
    finally:
        env.close()


if __name__ == "__main__":
    main()
