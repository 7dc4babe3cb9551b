"""Evaluation results: per-rollout rows, success rate, mean reward, and TGC / SGC overall and per
difficulty (computed as ``appworld evaluate`` computes them). Shared by ``loop-eval`` and the
trainer's periodic evaluation."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .envs.appworld.metrics import goal_completion_report
from .rollout import RolloutEngine, TransformersBackend, mix_seed
from .trajectory import Trajectory
from .viewer import write_viewer


def evaluation_row(trajectory: Trajectory, task: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """A trajectory as an evaluation result (token-level fields dropped). Success is the
    environment's, or reward 1 where it defines none."""
    row = trajectory.to_dict()
    for key in ("token_ids", "loss_mask", "sampler_logprobs"):
        row.pop(key)
    if row["success"] is None and row["status"] == "completed":
        row["success"] = row["reward"] >= 1.0
    row["difficulty"] = int(task.get("difficulty") or 0)
    row.update(extra)
    return row


def summarize(rows: list[dict[str, Any]], rollouts_per_task: int) -> dict[str, Any]:
    """Per rollout index: TGC/SGC reports; overall: their means, success rate and mean reward.
    A rollout that failed to run counts as unsuccessful (reward 0): nothing is dropped."""
    per_rollout = []
    for k in range(rollouts_per_task):
        mine = [r for r in rows if r["rollout"] == k]
        results = {r["task_id"]: {"success": r["status"] == "completed" and bool(r["success"]),
                                  "difficulty": r["difficulty"]} for r in mine}
        per_rollout.append(goal_completion_report(results))
    mean = {
        level: {key: sum(report[level][key] for report in per_rollout) / len(per_rollout) for key in ("tgc", "sgc")}
        for level in per_rollout[0]
    }
    completed = [r for r in rows if r["status"] == "completed"]
    return {
        "num_rollouts": len(rows),
        "num_failed_to_run": len(rows) - len(completed),
        "success_rate": sum(bool(r["success"]) for r in completed) / len(rows) if rows else float("nan"),
        "reward_mean": sum(float(r["reward"]) for r in completed) / len(rows) if rows else float("nan"),
        "goal_completion": mean,
        "goal_completion_per_rollout": per_rollout,
    }


def format_report(metrics: dict[str, Any]) -> str:
    lines = [f"{'':14} {'TGC':>6} {'SGC':>6}"]
    for level, values in metrics["goal_completion"].items():
        lines.append(f"{level:14} {values['tgc']:6.1f} {values['sgc']:6.1f}")
    lines.append(f"success rate {metrics['success_rate']:.3f} · mean reward {metrics['reward_mean']:.3f} · "
                 f"{metrics['num_rollouts']} rollouts ({metrics['num_failed_to_run']} failed to run)")
    return "\n".join(lines)


class EvaluationMixin:
    """LOOPTrainer's periodic evaluation (mixed into LOOPTrainer, before GRPOTrainer)."""

    def evaluate_policy(self, split: str | None = None) -> dict[str, float]:
        """Roll out every task of ``split`` (default ``args.eval_split``) ``eval_rollouts_per_task``
        times at ``eval_temperature`` (0: greedy) and return ``eval_*`` metrics: success rate, mean
        reward, TGC and SGC overall and per difficulty. No update; the latest result also goes
        into the model card."""
        args = self.args
        split = split or args.eval_split
        if split not in self._eval_tasks:
            tasks = self.env.tasks(split)
            if args.eval_max_tasks is not None:
                tasks = tasks.select(range(min(args.eval_max_tasks, len(tasks))))
            self._eval_tasks[split] = list(tasks)
        tasks = self._eval_tasks[split]
        if self._eval_engine is None:
            backend = self.generation_backend if self._custom_backend else (
                self.eval_generation_backend(args.eval_temperature) or TransformersBackend(
                    self.model, stop_token_ids=self.eos_token_ids, pad_token_id=self.tokenizer.pad_token_id,
                    temperature=args.eval_temperature, max_batch_size=args.generation_batch_limit))
            engine = self.rollout_engine
            self._eval_engine = RolloutEngine(self.env, backend, self.formatter, engine.limits, env_timeout=engine.env_timeout,
                                              max_concurrent_episodes=engine.max_concurrent_episodes,
                                              show_progress=engine.show_progress)
        synced = self.sync_generator()  # the generator samples the policy being evaluated
        batch = self._collect(self._eval_engine, tasks, args.eval_rollouts_per_task,
                              seed=mix_seed(args.seed, 0xE7A1, self.state.global_step),
                              description=f"evaluation on {split}")
        by_id = {str(task["task_id"]): task for task in tasks}
        rows = [evaluation_row(t, by_id[t.task_id]) for t in (*batch.trajectories, *batch.failed)]
        summary = summarize(rows, args.eval_rollouts_per_task)
        completion = summary["goal_completion"]
        self.latest_eval = {"split": split, "iteration": self.state.global_step,
                            "tgc": completion["aggregate"]["tgc"], "sgc": completion["aggregate"]["sgc"],
                            "per_difficulty": {k: v for k, v in completion.items() if k != "aggregate"},
                            "success_rate": summary["success_rate"]}
        if self.is_world_process_zero() and args.viewer_rollouts_per_iteration > 0:
            write_viewer(sorted(rows, key=lambda r: (r["task_id"], r["rollout"])),
                         Path(args.output_dir) / "viewer" / f"eval-{split}-iteration-{self.state.global_step:05d}.html",
                         title=f"{self.env.name}: {split} after iteration {self.state.global_step}")
        metrics = {"eval_success_rate": summary["success_rate"], "eval_reward_mean": summary["reward_mean"],
                   "eval_num_failed": float(summary["num_failed_to_run"]),
                   "eval_tgc": completion["aggregate"]["tgc"], "eval_sgc": completion["aggregate"]["sgc"]}
        for level in (1, 2, 3):
            values = completion[f"difficulty_{level}"]
            metrics[f"eval_tgc_difficulty_{level}"], metrics[f"eval_sgc_difficulty_{level}"] = values["tgc"], values["sgc"]
        return {**metrics, **synced}
