"""Checkpoints the master orchestrates, and resuming from them.

A checkpoint is written into `checkpoints/stepNNNNNN.tmp/` (workers write weights, optimizer and
RNG state; the master writes `master.json` with the step and the data position) and only then
renamed to `checkpoints/stepNNNNNN/`. A directory without `.tmp` is therefore complete: a
process that dies while writing leaves a `.tmp` directory that recovery never uses.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 2


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest_complete_checkpoint(run_dir: Path) -> Path | None:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return None
    complete = sorted(p for p in root.glob("step*") if p.is_dir() and not p.name.endswith(".tmp")
                      and (p / "master.json").is_file())
    return complete[-1] if complete else None


async def save(master, data, run_dir: Path, step: int) -> Path:
    root = checkpoint_root(run_dir)
    final = root / f"step{step:06d}"
    staging = root / f"step{step:06d}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    await master.broadcast("save", {"directory": str(staging.resolve())})
    state = {"step": step, "data": data.state_dict()}
    (staging / "master.json").write_text(json.dumps(state, indent=1))
    staging.rename(final)
    for old in sorted(p for p in root.glob("step*") if not p.name.endswith(".tmp"))[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    logger.info("saved checkpoint %s", final)
    return final


async def restore(master, data, checkpoint: Path, plan) -> int:
    """Load `checkpoint` into every worker and the data iterator; returns the step to run next."""
    state = json.loads((checkpoint / "master.json").read_text())
    await master.broadcast("load", {"directory": str(checkpoint.resolve())})
    data.load_state_dict(state["data"])
    return int(state["step"])
