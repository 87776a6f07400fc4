"""What a user sees of a run: a progress line per step, metrics.jsonl, samples.jsonl, wandb,
tensorboard, and a PNG plot of the main curves at the end. See docs/metrics.md for the keys.

The progress line (`progress_line`) starts with `step N/T | `: the launcher's console
(`realrl.launcher.console`) recognises it by `parse_progress_line` and, on a terminal, redraws
it in place as one short line; log files and non-terminal consoles get every line in full.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from pathlib import Path

from realrl.api.config import BaseExperimentConfig, WandbMode

logger = logging.getLogger(__name__)

# (metrics key, short label) shown in the progress line when present, most important first:
# a terminal shows the line cut to its width.
SUMMARY_KEYS = (
    ("reward/task_mean", "reward"),
    ("actor_gen/tool_call_fraction", "tools"),
    ("actor_train/kl_to_ref", "kl"),
    ("actor_gen/response_length", "len"),
    ("genDefault/response_length", "len"),
    ("trainDefault/loss", "loss"),
    ("actor_train/loss", "loss"),
    ("actor_train/clip_fraction", "clip"),
)
PLOT_KEYS = ("reward/task_mean", "actor_gen/tool_call_fraction", "actor_train/kl_to_ref",
             "actor_gen/response_length", "timing/step_s")
_PROGRESS = re.compile(r"^step (\d+)/(\d+) \| ")


def _wandb_mode(mode: WandbMode) -> str:
    if mode != WandbMode.auto:
        return mode.value
    has_key = os.environ.get("WANDB_API_KEY") or (Path.home() / ".netrc").is_file()
    return "online" if has_key else "offline"


def format_duration(seconds: float | None) -> str:
    """`?` (not known yet), `42s`, `6m05s` or `2h03m`."""
    if seconds is None:
        return "?"
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def progress_line(step: int, total_steps: int, eta_s: float | None, metrics: dict[str, float],
                  per_sample_keys: list[str] = ()) -> str:
    """`step 4/20 | eta 11s | reward 0.25 | rm_scores 0.31 | kl ... | 0.69s/step | actor_gen
    0.02 ...`: the summary first, then the seconds of every MFC."""
    parts = [f"step {step}/{total_steps}", f"eta {format_duration(eta_s)}"]
    shown = set()
    summary = list(SUMMARY_KEYS[:1]) + [(f"batch/{key}/mean", key) for key in per_sample_keys]
    for key, label in summary + list(SUMMARY_KEYS[1:]):
        if key in metrics and label not in shown:
            parts.append(f"{label} {metrics[key]:.4g}")
            shown.add(label)
    parts.append(f"{metrics.get('timing/step_s', 0.0):.2f}s/step")
    mfc_times = [f"{key.split('/', 1)[1]} {value:.2f}" for key, value in metrics.items()
                 if key.startswith("timing/") and key != "timing/step_s" and "/" not in
                 key.split("/", 1)[1]]
    if mfc_times:
        parts.append(" ".join(mfc_times))
    return " | ".join(parts)


def parse_progress_line(line: str) -> tuple[int, int] | None:
    """(step, total steps) of a `progress_line`, None for any other line."""
    match = _PROGRESS.match(line)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


class MetricsLogger:
    def __init__(self, run_dir: Path, base: BaseExperimentConfig, first_step: int):
        self.run_dir = run_dir
        self.total_steps = base.total_train_steps
        self.per_sample_keys = list(base.log.per_sample_keys)
        self.path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        self.first_step = first_step
        # The first step after a (re)start carries one-time costs (torch.compile, worker pools,
        # first allocations: 6.2 s against 0.1 s per later step with gen.compile=true), so the
        # ETA is timed from the end of that step: (time, step) of the first line logged.
        self._first_logged: tuple[float, int] | None = None
        for path in (self.path, self.samples_path):
            drop_steps_after(path, first_step)
        self._wandb = self._start_wandb(base)
        self._tensorboard = self._start_tensorboard(base)

    def _start_wandb(self, base: BaseExperimentConfig):
        mode = _wandb_mode(base.wandb.mode)
        if mode == "disabled":
            return None
        try:
            import wandb

            return wandb.init(
                mode=mode, dir=str(self.run_dir), project=base.wandb.project or base.experiment_name,
                entity=base.wandb.entity, group=base.wandb.group or base.trial_name,
                name=f"{base.experiment_name}_{base.trial_name}", tags=base.wandb.tags,
                resume="allow", id=f"{base.experiment_name}-{base.trial_name}".replace("/", "-"),
            )
        except Exception as exc:  # wandb problems must not stop training
            logger.warning("wandb (mode=%s) could not start: %s; continuing without it", mode, exc)
            return None

    def _start_tensorboard(self, base: BaseExperimentConfig):
        if not base.tensorboard:
            return None
        try:
            from torch.utils.tensorboard.writer import FileWriter
        except ImportError:
            logger.warning(
                "tensorboard=true but the `tensorboard` package is not installed, so no "
                "tensorboard/ directory is written; `pip install tensorboard` (a dependency of "
                "realrl: `pip install -e .` installs it), or set tensorboard=false to silence this"
            )
            return None
        return FileWriter(str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics}
        with self.path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._tensorboard is not None:
            self._tensorboard.add_summary(_scalars_summary(metrics), step)
        line = progress_line(step, self.total_steps, self.eta_s(step), metrics,
                             self.per_sample_keys)
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def eta_s(self, step: int, now: float | None = None) -> float | None:
        """Seconds left after `step`, at the mean pace of the steps since the first one of this
        (re)start; None at that first step, whose pace is no guide."""
        now = time.perf_counter() if now is None else now
        if self._first_logged is None:
            self._first_logged = (now, step)
        started, first = self._first_logged
        if step == first:
            return None if step < self.total_steps else 0.0
        return (now - started) / (step - first) * (self.total_steps - step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """A few generated samples of `step` (`realrl.workers.samples_log.sample_rows`)."""
        if not rows:
            return
        with self.samples_path.open("a", encoding="utf-8") as stream:
            stream.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
        if self._wandb is not None:
            import wandb

            columns = list(dict.fromkeys(column for row in rows for column in row))
            table = wandb.Table(columns=columns,
                                data=[[row.get(column) for column in columns] for row in rows])
            self._wandb.log({"samples": table}, step=step)
        if self._tensorboard is not None:
            from torch.utils.tensorboard.summary import text

            self._tensorboard.add_summary(text("samples", samples_markdown(rows)), step)

    def finish(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()
        try:
            plot_metrics(self.path, self.run_dir / "metrics.png")
        except Exception as exc:  # a plot must never fail a finished run
            logger.warning("could not plot metrics: %s", exc)


def _scalars_summary(metrics: dict[str, float]):
    """Every metric of a step in one tensorboard summary: one event a step. `add_scalar` writes
    an event per metric, ~5x the master's time for a step's ~60 metrics (2.8 against 0.6 ms)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=key, simple_value=float(value))
                          for key, value in metrics.items()])


def samples_markdown(rows: list[dict]) -> str:
    """Samples as Markdown for tensorboard's text tab: the scalars, then prompt and response as
    indented (verbatim) blocks."""

    def verbatim(text: str) -> str:
        return "\n".join(f"    {line}" for line in text.splitlines() or [""])

    blocks = []
    for row in rows:
        scalars = " · ".join(f"**{key}** {value}" for key, value in row.items()
                             if key not in ("prompt", "response"))
        blocks.append(f"{scalars}\n\nprompt:\n\n{verbatim(row['prompt'])}\n\n"
                      f"response:\n\n{verbatim(row['response'])}")
    return "\n\n---\n\n".join(blocks)


def drop_steps_after(path: Path, step: int) -> None:
    """A resumed run re-does the steps after its checkpoint: forget what the interrupted attempt
    logged for them into `path` (metrics.jsonl, samples.jsonl), so that each step is there once."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
    if len(kept) != len(lines):
        logger.info("%s: dropping %d record(s) after step %d (the interrupted attempt's)",
                    path.name, len(lines) - len(kept), step)
        temporary = path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(kept))
        temporary.replace(path)


def _step_of(line: str) -> int | None:
    """The step of one JSON line; None for a line cut short by a killed process."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_metrics(metrics_path: Path, png_path: Path) -> None:
    """The main curves, plus the mean of every `log.per_sample_keys` key (`batch/<key>/mean`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    logged = sorted({key for r in records for key in r
                     if key.startswith("batch/") and key.endswith("/mean")})
    keys = [key for key in PLOT_KEYS[:1] + tuple(logged) + PLOT_KEYS[1:]
            if any(key in r for r in records)]
    if not records or not keys:
        return
    figure, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True)
    axes = [axes] if len(keys) == 1 else axes
    for axis, key in zip(axes, keys):
        points = [(r["step"], r[key]) for r in records if key in r]
        axis.plot([p[0] for p in points], [p[1] for p in points], marker=".")
        axis.set_ylabel(key, fontsize=8)
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
