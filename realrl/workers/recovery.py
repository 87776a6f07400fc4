"""Checkpoints the master orchestrates, and resuming from them.

A checkpoint is written into `checkpoints/stepNNNNNN.tmp/` (workers write weights, optimizer and
RNG state; the master writes `master.json` with the step and the data position) and only then
renamed to `checkpoints/stepNNNNNN/`. A directory without `.tmp` is therefore complete: a
process that dies while writing leaves a `.tmp` directory that recovery never uses.

`checkpoint.keep_last=N` keeps the N newest complete checkpoints: older ones are deleted right
after a new one is renamed complete, so at every moment at least one complete checkpoint
exists. `checkpoint.weights_only=true` leaves the optimizer state out (see
`realrl.workers.checkpointing`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / "master.json").is_file())


def latest_complete_checkpoint(run_dir: Path) -> Path | None:
    complete = complete_checkpoints(run_dir)
    return complete[-1] if complete else None


async def save(master, data, run_dir: Path, step: int) -> Path:
    root = checkpoint_root(run_dir)
    final = root / f"step{step:06d}"
    staging = root / f"step{step:06d}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    await master.broadcast("save", {"directory": str(staging.resolve())})
    settings = master.plan.base.checkpoint
    state = {"step": step, "data": data.state_dict(), "weights_only": settings.weights_only}
    (staging / "master.json").write_text(json.dumps(state, indent=1))
    staging.rename(final)
    logger.info("saved checkpoint %s (%.1f MB)", final, _size_bytes(final) / 1e6)
    if settings.keep_last:
        for old in complete_checkpoints(run_dir)[: -settings.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
            logger.info("deleted checkpoint %s (checkpoint.keep_last=%d)", old, settings.keep_last)
    return final


def _size_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


async def restore(master, data, checkpoint: Path, plan) -> int:
    """Load `checkpoint` into every worker and the data iterator; returns the step to run next."""
    state = json.loads((checkpoint / "master.json").read_text())
    if state.get("weights_only"):
        logger.warning(
            "%s is weights-only (checkpoint.weights_only=true): resuming at its step, data "
            "position and learning rate with AdamW's moments starting again from zero, so the "
            "next updates differ from an uninterrupted run's",
            checkpoint,
        )
    await master.broadcast("load", {"directory": str(checkpoint.resolve())})
    data.load_state_dict(state["data"])
    return int(state["step"])
