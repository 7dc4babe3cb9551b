"""What LOOP sends to the trackers of ``report_to`` beyond the per-iteration metrics.

transformers' own callbacks (``WandbCallback``, ``TensorBoardCallback``, ``TrackioCallback``) log every
``Trainer.log`` call, which LOOP makes once per iteration after ``global_step`` counts it: each iteration's
metrics have the iteration as their step (wandb's ``train/global_step``, tensorboard's ``global_step``), and
the ``LOOPConfig`` goes to the tracker's config (wandb) or an ``args`` text (tensorboard) when training begins.
:class:`TrackerLog` adds, on the main process, to wandb and tensorboard:

- the run's settings from outside ``LOOPConfig`` (the environment, its kwargs, the number of training tasks);
- a table of sampled trajectories every ``log_trajectories_every`` iterations: task, rollout, reward,
  advantage, whether it was kept (trained), how it ended, and its transcript (wandb: a ``wandb.Table``;
  tensorboard: a markdown text), ``num_trajectories_to_log`` of them chosen as for the viewer page (any that
  failed to run, then the best and the worst in turn);
- the learning curve image at the end of training;
- the collapse warning (:mod:`.signals`): a wandb alert; in tensorboard, a ``warnings`` text.

Other trackers (trackio, mlflow, ...) get what their transformers callback sends: the metrics and the config.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback
from transformers.integrations.integration_utils import TensorBoardCallback, WandbCallback

from .run_log import chosen_rollouts

if TYPE_CHECKING:
    from ..rollout import RolloutBatch
    from ..trajectory import Trajectory

logger = logging.getLogger(__name__)

TABLE_KEY = "trajectories"
CURVE_KEY = "learning_curve"
RUN_SETTINGS_KEY = "loop_run"
ALERT_TITLE = "LOOP: learning may be collapsing"
TABLE_COLUMNS = (
    "iteration",
    "task_id",
    "rollout",
    "status",
    "ending",
    "turns",
    "reward",
    "success",
    "advantage",
    "kept",
    "transcript",
)
WANDB_STEP = "train/global_step"  # WandbCallback's x-axis for every key ("*")


@dataclass(frozen=True)
class TrackerSettings:
    """The tables of sampled trajectories (``log_trajectories_every``, ``num_trajectories_to_log``)."""

    trajectories_every: int
    """Iterations between tables; 0: none."""
    trajectories_per_table: int | None
    """Trajectories in each table; None: all of the iteration's."""


def transcript(trajectory: Trajectory) -> str:
    """The conversation as plain text, one ``[role] content`` paragraph per message."""
    return "\n\n".join(f"[{message.get('role', '?')}] {message.get('content', '')}" for message in trajectory.messages)


def trajectory_rows(
    iteration: int, trajectories: Sequence[Trajectory], advantages: Mapping[int, float], kept: Collection[int]
) -> list[list[Any]]:
    """One row per trajectory, in :data:`TABLE_COLUMNS`' order. ``advantages`` and ``kept`` hold
    ``id(trajectory)``'s (a trajectory that failed to run has no advantage and is never kept)."""
    rows = []
    for trajectory in trajectories:
        advantage = advantages.get(id(trajectory))
        rows.append(
            [
                iteration,
                trajectory.task_id,
                trajectory.rollout,
                trajectory.status,
                trajectory.ending,
                trajectory.num_turns,
                float(trajectory.reward),
                trajectory.success,
                None if advantage is None else float(advantage),
                id(trajectory) in kept,
                transcript(trajectory),
            ]
        )
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:+.4g}"
    return str(value).replace("|", "\\|")


def markdown_table(rows: Sequence[Sequence[Any]], header: str) -> str:
    """tensorboard's text: ``header``, a table of every column but the transcript, then each transcript."""
    columns = TABLE_COLUMNS[:-1]
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row[:-1]) + " |" for row in rows]
    for row in rows:
        task, rollout, transcript_text = row[1], row[2], row[-1]
        fence = "~~~~"  # a transcript may hold ``` fences of its own
        lines += ["", f"**{task}, rollout {rollout}**", "", fence, transcript_text, fence]
    return "\n".join(lines)


class TrackerLog:
    """LOOP's extras for the trackers among the trainer's callbacks (see the module's docstring). Only the main
    process (``writes``) sends anything; with no wandb or tensorboard callback, every method does nothing."""

    def __init__(self, settings: TrackerSettings, callbacks: Sequence[TrainerCallback], *, writes: bool):
        self.settings = settings
        self.writes = writes
        self.wandb = next((c for c in callbacks if isinstance(c, WandbCallback)), None)
        self.tensorboard = next((c for c in callbacks if isinstance(c, TensorBoardCallback)), None)
        self.locations: dict[str, str] = {}
        """Where each tracker's run is ({"wandb": ..., "tensorboard": ...}), once training has begun."""

    @property
    def active(self) -> bool:
        return self.writes and (self.wandb is not None or self.tensorboard is not None)

    def _wandb_run(self) -> Any:
        """wandb's run, once WandbCallback started it (on_train_begin); None before, or without wandb."""
        if self.wandb is None or not self.writes:
            return None
        import wandb

        return wandb.run

    def _tensorboard_writer(self) -> Any:
        """The callback's SummaryWriter (opened by its on_train_begin, closed by its on_train_end)."""
        return self.tensorboard.tb_writer if self.tensorboard is not None and self.writes else None

    def start(self, run_settings: Mapping[str, Any]) -> None:
        """After the callbacks' ``on_train_begin``: the run's settings from outside LOOPConfig, where the trackers'
        runs are, and one line saying what the tables hold."""
        if not self.active:
            return
        settings = json.loads(json.dumps(dict(run_settings), default=str))  # plain values, as a config holds
        if (run := self._wandb_run()) is not None:
            run.config.update({RUN_SETTINGS_KEY: settings}, allow_val_change=True)
            run_dir = str(Path(run.dir).parent)  # run.dir is the run's files/ folder
            self.locations["wandb"] = (
                f"{run_dir} (offline: upload with `wandb sync {run_dir}`)"
                if run.offline  # (asking an offline run for its url prints a warning)
                else f"{run.url} (files: {run_dir})"
            )
        if (writer := self._tensorboard_writer()) is not None:
            writer.add_text(RUN_SETTINGS_KEY, "```\n" + json.dumps(settings, indent=2) + "\n```")
            assert self.tensorboard is not None  # the writer is its
            logdir = self.tensorboard.logging_dir
            self.locations["tensorboard"] = f"{logdir} (view: tensorboard --logdir {logdir})"
        every, count = self.settings.trajectories_every, self.settings.trajectories_per_table
        if every:
            logger.info(
                "report_to: a table of %s every %d iteration(s) (log_trajectories_every, num_trajectories_to_log)",
                "all of the iteration's trajectories"
                if count is None
                else f"up to {count} of the iteration's trajectories (any that failed to run, then the best and the "
                "worst)",
                every,
            )

    def trajectories(
        self, iteration: int, batch: RolloutBatch, advantages: Mapping[int, float], kept: Collection[int]
    ) -> None:
        """Iteration ``iteration``'s (1-based) table of sampled trajectories, every ``trajectories_every``."""
        every = self.settings.trajectories_every
        if not self.active or not every or iteration % every:
            return
        total = len(batch.trajectories) + len(batch.failed)
        count = self.settings.trajectories_per_table
        chosen = chosen_rollouts(batch, total if count is None else count)
        rows = trajectory_rows(iteration, chosen, advantages, kept)
        if (run := self._wandb_run()) is not None:
            import wandb

            table = wandb.Table(columns=list(TABLE_COLUMNS), data=rows)
            run.log({TABLE_KEY: table, WANDB_STEP: iteration})
        if (writer := self._tensorboard_writer()) is not None:
            header = f"iteration {iteration}: {len(rows)} of {total} trajectories"
            writer.add_text(TABLE_KEY, markdown_table(rows, header), iteration)
            writer.flush()

    def alert(self, warning: str, iteration: int) -> None:
        """The collapse warning: a wandb alert (an e-mail or Slack message, as the user's wandb settings say);
        tensorboard has no alerts, so a ``warnings`` text at the iteration."""
        if not self.active:
            return
        if (run := self._wandb_run()) is not None:
            run.alert(title=ALERT_TITLE, text=warning, level="WARN")
        if (writer := self._tensorboard_writer()) is not None:
            writer.add_text("warnings", warning, iteration)
            writer.flush()

    def curve(self, path: Path | None, iteration: int) -> None:
        """The learning curve image (``path``: the PNG the run log just drew; None when it drew none)."""
        if not self.active or path is None or not path.exists():
            return
        if (run := self._wandb_run()) is not None:
            import wandb

            run.log({CURVE_KEY: wandb.Image(str(path)), WANDB_STEP: iteration})
        if (writer := self._tensorboard_writer()) is not None:
            from matplotlib import image

            pixels = image.imread(path)[..., :3]  # RGB floats in [0, 1]; the PNG's alpha is dropped
            writer.add_image(CURVE_KEY, pixels, iteration, dataformats="HWC")
            writer.flush()
