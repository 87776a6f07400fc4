"""What a user sees of a run: progress bar, a compact line per step, metrics.jsonl, wandb,
tensorboard, and a PNG plot of the main curves at the end. See docs/metrics.md for the keys."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from realrl.api.config import BaseExperimentConfig, WandbMode

logger = logging.getLogger(__name__)

# (metrics key, short label) shown in the per-step line when present.
SUMMARY_KEYS = (
    ("reward/task_mean", "reward"),
    ("actor_train/kl_to_ref", "kl"),
    ("actor_train/clip_fraction", "clip"),
    ("actor_gen/response_length", "len"),
    ("trainDefault/loss", "loss"),
    ("actor_train/loss", "loss"),
)
PLOT_KEYS = ("reward/task_mean", "actor_train/kl_to_ref", "actor_gen/response_length",
             "timing/step_s")


def _wandb_mode(mode: WandbMode) -> str:
    if mode != WandbMode.auto:
        return mode.value
    has_key = os.environ.get("WANDB_API_KEY") or (Path.home() / ".netrc").is_file()
    return "online" if has_key else "offline"


class MetricsLogger:
    def __init__(self, run_dir: Path, base: BaseExperimentConfig, first_step: int):
        self.run_dir = run_dir
        self.total_steps = base.total_train_steps
        self.path = run_dir / "metrics.jsonl"
        self.started = time.perf_counter()
        self.first_step = first_step
        self._drop_steps_after(first_step)
        self._wandb = self._start_wandb(base)
        self._tensorboard = self._start_tensorboard(base)

    def _drop_steps_after(self, step: int) -> None:
        """A resumed run re-does the steps after its checkpoint: forget what the interrupted
        attempt logged for them, so that metrics.jsonl holds each step once."""
        if not self.path.is_file():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
        if len(kept) != len(lines):
            logger.info("metrics.jsonl: dropping %d record(s) after step %d (the interrupted "
                        "attempt's)", len(lines) - len(kept), step)
            temporary = self.path.with_suffix(".jsonl.tmp")
            temporary.write_text("".join(kept))
            temporary.replace(self.path)

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
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
        return SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics}
        with self.path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._tensorboard is not None:
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key, value, step)
        sys.stdout.write(self._line(step, metrics) + "\n")
        sys.stdout.flush()

    def _line(self, step: int, metrics: dict[str, float]) -> str:
        done = step - self.first_step
        elapsed = time.perf_counter() - self.started
        eta = elapsed / max(done, 1) * (self.total_steps - step)
        width = 20
        filled = int(width * step / max(self.total_steps, 1))
        parts = [f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total_steps}",
                 f"eta {eta:5.0f}s"]
        shown = set()
        for key, label in SUMMARY_KEYS:
            if key in metrics and label not in shown:
                parts.append(f"{label} {metrics[key]:.4g}")
                shown.add(label)
        parts.append(f"step {metrics.get('timing/step_s', 0.0):.2f}s")
        mfc_times = [f"{key.split('/', 1)[1]} {value:.2f}" for key, value in metrics.items()
                     if key.startswith("timing/") and key != "timing/step_s" and "/" not in
                     key.split("/", 1)[1]]
        if mfc_times:
            parts.append("(" + ", ".join(mfc_times) + ")")
        return " | ".join(parts)

    def finish(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()
        try:
            plot_metrics(self.path, self.run_dir / "metrics.png")
        except Exception as exc:  # a plot must never fail a finished run
            logger.warning("could not plot metrics: %s", exc)


def _step_of(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a line cut short by a killed process."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_metrics(metrics_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    keys = [key for key in PLOT_KEYS if any(key in r for r in records)]
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
