"""The run log: metrics.jsonl (one object per iteration), the learning curve, the viewer pages of each
iteration's rollouts, saved rollouts, and the console line per iteration (where it goes: :mod:`.console`)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from datasets import Dataset
from tqdm.auto import tqdm
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from ..interrupts import deferred_interrupt
from ..viewer import write_viewer
from .console import IterationClock, format_duration, progress_bars_visible

if TYPE_CHECKING:
    from ..rollout import RolloutBatch
    from ..trajectory import Trajectory

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "learning_curve.png"
PLOT_INTERVAL_SECONDS = 10.0


def append_metrics(output_dir: str | os.PathLike[str], record: Mapping[str, Any]) -> Path:
    path = Path(output_dir) / METRICS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    with path.open("a") as handle:
        handle.write(json.dumps(clean) + "\n")
    return path


def read_metrics(output_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The iterations ``metrics.jsonl`` holds. A last line that is not whole JSON is a run killed while writing it
    (a time limit, SIGKILL): it is left out and logged; a broken line before the last is an error."""
    path = Path(output_dir) / METRICS_FILE
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines[:-1]]
    if lines:
        try:
            records.append(json.loads(lines[-1]))
        except json.JSONDecodeError:
            logger.warning("%s: its last line is cut short (a run stopped while writing it); read without it", path)
    return records


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display), imported on first use: seconds, the first time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_learning_curve(history: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Reward (mean +- std per iteration, and a moving average) and success; kept fraction, tied groups and
    clip fraction; the policy's entropy and the truncated fraction (the learning signals)."""
    plt = _pyplot()

    def series(key: str) -> list[float]:
        return [float(h[key]) if h.get(key) is not None else math.nan for h in history]

    iterations = [int(h["iteration"]) for h in history]
    reward, std = series("reward_mean"), series("reward_std")
    fig, (top, bottom, signals) = plt.subplots(3, 1, figsize=(7, 8), sharex=True, height_ratios=(2, 1, 1))
    top.plot(iterations, reward, color="tab:blue", alpha=0.45, label="reward (iteration mean)")
    top.fill_between(
        iterations,
        [r - s for r, s in zip(reward, std, strict=True)],
        [r + s for r, s in zip(reward, std, strict=True)],
        color="tab:blue",
        alpha=0.1,
        linewidth=0,
    )
    top.plot(
        iterations,
        _moving_average([0.0 if math.isnan(r) else r for r in reward], 5),
        color="tab:blue",
        linewidth=2,
        label="reward (5-iteration average)",
    )
    if any(not math.isnan(v) for v in series("success_rate")):
        top.plot(iterations, series("success_rate"), color="tab:green", alpha=0.7, label="success rate")
    top.set_ylim(-0.02, 1.02)
    top.set_ylabel("reward")
    top.legend(loc="upper left", fontsize=8)
    top.grid(alpha=0.3)
    top.set_title("LOOP training")
    bottom.plot(iterations, series("kept_fraction"), color="tab:orange", label="kept fraction")
    bottom.plot(iterations, series("tied_group_fraction"), color="tab:purple", label="tied groups")
    bottom.plot(iterations, series("clip_frac"), color="tab:red", label="clip fraction")
    bottom.legend(loc="upper left", fontsize=8)
    bottom.grid(alpha=0.3)
    signals.plot(iterations, series("entropy"), color="tab:gray", marker=".", label="entropy (nats/token)")
    signals.set_ylabel("entropy")
    truncated = signals.twinx()
    truncated.plot(iterations, series("truncated_fraction"), color="tab:brown", alpha=0.6, label="truncated fraction")
    truncated.set_ylim(-0.02, 1.02)
    signals.legend(loc="upper left", fontsize=8)
    truncated.legend(loc="upper right", fontsize=8)
    signals.set_xlabel("iteration")
    signals.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_iteration(
    iteration: int, record: Mapping[str, Any], total: int | None = None, eta: float | None = None
) -> str:
    """One readable line per iteration for the console (the full record goes to metrics.jsonl):
    ``iteration 3/120: reward ... 2.1s  ETA 4m10s`` (``total`` and ``eta`` in seconds, when known)."""

    def number(key: str, spec: str = ".3f") -> str:
        value = record.get(key)
        return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    line = (
        f"iteration {iteration}{f'/{total}' if total else ''}: reward {number('reward_mean')} ± "
        f"{number('reward_std', '.2f')}"
        f"  success {number('success_rate', '.2f')}"
        f"  kept {number('num_kept', '.0f')}/{number('num_rollouts', '.0f')}"
        f"  tied {number('tied_group_fraction', '.2f')}  entropy {number('entropy', '.3f')}"
        f"  kl {number('kl', '.4f')}  clip {number('clip_frac', '.3f')}"
        f"  {number('seconds', '.1f')}s"
    )
    failed = record.get("num_failed") or 0
    line += f"  FAILED {failed:.0f}" if failed else ""
    return line + (f"  ETA {format_duration(eta)}" if eta is not None else "")


class _IterationLine:
    """Print :func:`format_iteration`, with the iteration count and the ETA, instead of transformers' raw
    dict of every logged value: above the progress bar when there is one, else as a plain line of its own."""

    training_bar: Any = None
    clock: IterationClock | None = None

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - TrainerCallback signature
        self.clock = IterationClock()
        self.clock.start(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001 - TrainerCallback signature
        if not state.is_world_process_zero or not logs or "reward_mean" not in logs:
            return
        eta = self.clock.eta(state.global_step, state.max_steps) if self.clock is not None else None
        line = format_iteration(state.global_step, logs, total=state.max_steps, eta=eta)
        if self.training_bar is not None:
            self.training_bar.write(line)
        else:
            print(line, flush=True)


class LOOPProgressCallback(_IterationLine, ProgressCallback):
    """transformers' progress bar over iterations, with one readable line per iteration; only where the
    bar can be seen (:func:`.console.progress_bars_visible`): in a log file, the lines alone."""

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - TrainerCallback signature
        super().on_train_begin(args, state, control, **kwargs)  # the clock (_IterationLine's)
        self.training_bar = None
        if state.is_world_process_zero and progress_bars_visible():
            # from the iteration a resumed run starts at
            self.training_bar = tqdm(total=state.max_steps, initial=state.global_step, dynamic_ncols=True)
        self.current_step = state.global_step

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001 - TrainerCallback signature
        if self.training_bar is not None:
            self.training_bar.update(state.global_step - self.current_step)
        self.current_step = state.global_step

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001 - TrainerCallback signature
        if self.training_bar is not None:
            self.training_bar.close()
        self.training_bar = None


class LOOPPrinterCallback(_IterationLine, PrinterCallback):
    """One readable line per iteration when progress bars are disabled."""


class RunLog:
    """What a person reads while a run goes: ``metrics.jsonl`` (one object per iteration), the
    learning curve, the viewer pages of each iteration's rollouts and, if asked, the rollouts
    themselves. Only the main process writes; every process keeps the history."""

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        *,
        writes: bool,
        env_name: str,
        plot_curves: bool = True,
        viewer_rollouts_per_iteration: int = 0,
        save_rollouts: bool = False,
    ):
        self.output_dir = Path(output_dir)
        self.writes = writes
        self.env_name = env_name
        self.plot_curves = plot_curves
        self.viewer_rollouts_per_iteration = viewer_rollouts_per_iteration
        self.save_rollouts = save_rollouts
        self.history: list[dict[str, Any]] = []
        self._last_plot = -math.inf

    @property
    def metrics_path(self) -> Path:
        return self.output_dir / METRICS_FILE

    @property
    def curve_path(self) -> Path:
        return self.output_dir / CURVE_FILE

    def start(self, history: Sequence[Mapping[str, Any]] = ()) -> None:
        """Begin a run, or continue one from a checkpoint's ``history`` (iterations after the
        checkpoint are redone, so their lines are dropped)."""
        self.history = [dict(record) for record in history]
        if self.writes:
            self.metrics_path.unlink(missing_ok=True)
            for record in self.history:
                append_metrics(self.output_dir, record)

    def record(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self.writes:
            append_metrics(self.output_dir, record)
            self.plot()

    def plot(self, force: bool = False) -> Path | None:
        """Redraw the learning curve (``force``: now, else at most every PLOT_INTERVAL_SECONDS); its path if drawn."""
        # Redrawing costs ~0.3 s: often enough to watch a run, not every iteration of a fast one.
        if not self.plot_curves or not self.history or not self.writes:
            return None
        if force or time.monotonic() - self._last_plot >= PLOT_INTERVAL_SECONDS:
            # A Ctrl-C waits for the drawing: matplotlib makes and drops objects with weak references by the
            # thousand, and a KeyboardInterrupt raised in a weak reference's callback is printed and lost (4 of 60
            # Ctrl-Cs sent while drawing; the run went on to its last iteration), or turned into another error.
            _pyplot()  # imported before: a Ctrl-C during the import need not wait for it
            with deferred_interrupt():
                path = plot_learning_curve(self.history, self.curve_path)
            self._last_plot = time.monotonic()
            return path
        return None

    def rollouts(self, iteration: int, batch: RolloutBatch, advantages: Mapping[int, float]) -> None:
        """The viewer page of ``iteration`` (1-based) and, with ``save_rollouts``, every trajectory;
        ``advantages`` maps ``id(trajectory)`` to its advantage."""
        if not self.writes:
            return
        if self.viewer_rollouts_per_iteration > 0:
            write_viewer(
                [
                    rollout_row(t, iteration, advantages)
                    for t in chosen_rollouts(batch, self.viewer_rollouts_per_iteration)
                ],
                self.output_dir / "viewer" / f"iteration-{iteration:05d}.html",
                title=f"{self.env_name}: iteration {iteration}",
            )
        if self.save_rollouts:
            rows = []
            for trajectory in (*batch.trajectories, *batch.failed):
                row = rollout_row(trajectory, iteration, advantages)
                row["info"] = json.dumps(row["info"], default=str)  # free-form: one string column for Arrow
                rows.append(row)
            folder = self.output_dir / "rollouts"
            folder.mkdir(parents=True, exist_ok=True)
            Dataset.from_list(rows).to_json(folder / f"iteration-{iteration:05d}.jsonl")


def chosen_rollouts(batch: RolloutBatch, count: int) -> list[Trajectory]:
    """``count`` of the batch's rollouts worth a look: those that failed to run, then the best and the worst in
    turn (all of them when ``count`` covers the batch)."""
    ranked = sorted(batch.trajectories, key=lambda t: t.reward)
    chosen = list(batch.failed[:count])
    while ranked and len(chosen) < count:
        chosen.append(ranked.pop())
        if ranked and len(chosen) < count:
            chosen.append(ranked.pop(0))
    return chosen


def rollout_row(trajectory: Trajectory, iteration: int, advantages: Mapping[int, float]) -> dict[str, Any]:
    row = trajectory.to_dict()
    row["iteration"] = iteration
    row["advantage"] = advantages.get(id(trajectory))
    return row
