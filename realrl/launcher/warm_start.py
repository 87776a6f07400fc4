"""Default model paths: the built-in tiny model, and ppo-math's SFT warm start of it.

Experiments whose config sets `default_model = "fresh"` (sft) start from randomly
initialised weights; the others (ppo-math, rw, dpo, gen) from the *warm start*: the fresh model
after realrl's own `sft` experiment on the built-in arithmetic data, built on first use by

    python -m realrl.apps.quickstart sft output_root=$REALRL_CACHE/build \
        experiment_name=default-actor trial_name=v1 <WARM_START_OVERRIDES>

and cached in `$REALRL_CACHE/default-actor-v1` (REALRL_CACHE defaults to ~/.cache/realrl).
It gets some arithmetic right and leaves RL room to improve. The result of that command ships
in the package (`realrl/assets/default-actor-v1`, 3 MB), so a fresh clone runs without
building it; `python -m realrl.launcher.warm_start` rebuilds it into the cache.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from realrl.api import environment

logger = logging.getLogger(__name__)

WARM_START_VERSION = "v1"
WARM_START_OVERRIDES = [
    "total_train_steps=1500", "dataset.batch_size=64", "model.optimizer.lr=3e-3",
    "model.optimizer.lr_scheduler=cosine", "model.optimizer.warmup_steps_proportion=0.05",
    "wandb.mode=disabled", "tensorboard=false", "seed=1", "n_devices_per_node=2",
]


def cache_dir() -> Path:
    return Path(os.environ.get(environment.CACHE, Path.home() / ".cache" / "realrl")).expanduser()


def default_model_path(config, section: str) -> Path:
    if getattr(config, "default_model", "warm") == "fresh":
        from realrl.launcher.defaults import fresh_default_model  # imports torch

        return fresh_default_model(cache_dir() / "default-fresh")
    return ensure_warm_start()


PACKAGED_ACTOR = Path(__file__).resolve().parents[1] / "assets" / f"default-actor-{WARM_START_VERSION}"


def ensure_warm_start(use_packaged: bool = True) -> Path:
    """The default actor's directory: the packaged one, else the cached one, else built now
    into the cache (about 1,500 SFT steps) by running `build_command` in a child process.

    A child process, not `realrl.launcher.run.run_experiment`: the launcher's preflight asks
    for this path before any runner starts, and a runner imported from here would close an
    import circle (preflight -> warm_start -> runner -> prepare -> preflight)."""
    if use_packaged and (PACKAGED_ACTOR / "config.json").is_file():
        return PACKAGED_ACTOR
    target = cache_dir() / f"default-actor-{WARM_START_VERSION}"
    if (target / "config.json").is_file():
        return target
    build_root = cache_dir() / "build"
    run_dir = build_root / "default-actor" / WARM_START_VERSION
    logger.info("building the default actor (SFT warm start) into %s; done once", target)
    if subprocess.run(build_command(build_root)).returncode != 0:
        raise RuntimeError(f"building the default actor failed; see {run_dir}/logs")
    from realrl.workers.recovery import latest_complete_checkpoint

    checkpoint = latest_complete_checkpoint(run_dir)
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(checkpoint / "default", staging,
                    ignore=shutil.ignore_patterns("optimizer*.pt"))
    staging.rename(target)
    return target


def build_command(build_root: Path) -> list[str]:
    """The command that trains the default actor, with its run directory
    `<build_root>/default-actor/<WARM_START_VERSION>` (the module docstring's command)."""
    return [sys.executable, "-m", "realrl.apps.quickstart", "sft", f"output_root={build_root}",
            "experiment_name=default-actor", f"trial_name={WARM_START_VERSION}",
            *WARM_START_OVERRIDES]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(levelname)s %(message)s")
    print(ensure_warm_start(use_packaged=False))
