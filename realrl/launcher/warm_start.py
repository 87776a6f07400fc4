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


def default_model_path(config, section: str) -> Path:
    default_model = getattr(config, "default_model", "warm")
    if default_model == "fresh":
        from realrl.launcher.defaults import fresh_default_model  # imports torch

        return fresh_default_model(environment.cache_dir() / "default-fresh")
    if default_model == "tool":
        return ensure_tool_warm_start()
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
    target = environment.cache_dir() / f"default-actor-{WARM_START_VERSION}"
    if (target / "config.json").is_file():
        return target
    build_root = environment.cache_dir() / "build"
    logger.info("building the default actor (SFT warm start) into %s; done once", target)
    _build(build_command(build_root), build_root / "default-actor" / WARM_START_VERSION, target)
    return target


def _build(command: list[str], run_dir: Path, target: Path) -> None:
    """Run an `sft` command and install its last checkpoint's model as `target`."""
    if subprocess.run(command).returncode != 0:
        raise RuntimeError(f"building {target.name} failed; see {run_dir}/logs")
    from realrl.workers.recovery import latest_complete_checkpoint

    checkpoint = latest_complete_checkpoint(run_dir)
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(checkpoint / "default", staging,
                    ignore=shutil.ignore_patterns("optimizer*.pt"))
    staging.rename(target)


# The default model of ppo-agent: the default actor after SFT on transcripts of the built-in
# multiplication task, TOOL_FRACTION of them solved with a tool call
# (`realrl.datasets.tool_arithmetic.as_tool_sft_records`), so that it knows the call format
# and calls a tool on about that fraction of problems.
TOOL_WARM_START_VERSION = "v1"
TOOL_FRACTION = 0.5
TOOL_WARM_START_OVERRIDES = [
    "total_train_steps=3000", "dataset.batch_size=64", "model.optimizer.lr=3e-3",
    "model.optimizer.lr_scheduler=cosine", "model.optimizer.warmup_steps_proportion=0.05",
    "wandb.mode=disabled", "tensorboard=false", "seed=1", "n_devices_per_node=1",
]


PACKAGED_AGENT = PACKAGED_ACTOR.with_name(f"default-agent-{TOOL_WARM_START_VERSION}")


def ensure_tool_warm_start(use_packaged: bool = True) -> Path:
    """ppo-agent's default actor: the packaged one (`realrl/assets/default-agent-v1`, the
    result of `tool_build_command`), else the cached one, else built now from
    `ensure_warm_start`'s (3,000 SFT steps, 4-10 minutes on 2 cores, done once;
    `python -m realrl.launcher.warm_start agent` rebuilds it into the cache)."""
    if use_packaged and (PACKAGED_AGENT / "config.json").is_file():
        return PACKAGED_AGENT
    target = environment.cache_dir() / f"default-agent-{TOOL_WARM_START_VERSION}"
    if (target / "config.json").is_file():
        return target
    build_root = environment.cache_dir() / "build"
    logger.info("building ppo-agent's default actor (SFT on tool calls) into %s; done once",
                target)
    _build(tool_build_command(build_root, ensure_warm_start()),
           build_root / "default-agent" / TOOL_WARM_START_VERSION, target)
    return target


def tool_build_command(build_root: Path, base_model: Path) -> list[str]:
    """Write the SFT transcripts into `build_root` and return the command that trains on them,
    from `base_model`, with its run directory `<build_root>/default-agent/<version>`."""
    from realrl.datasets.jsonl import write_jsonl
    from realrl.datasets.tool_arithmetic import as_tool_sft_records, make_multiplication_splits

    train, _ = make_multiplication_splits(4096, 256, seed=0)  # the built-in task's pool
    data = write_jsonl(as_tool_sft_records(train, seed=1, tool_fraction=TOOL_FRACTION),
                       build_root / f"agent-sft-{TOOL_WARM_START_VERSION}.jsonl")
    return [sys.executable, "-m", "realrl.apps.quickstart", "sft", f"output_root={build_root}",
            "experiment_name=default-agent", f"trial_name={TOOL_WARM_START_VERSION}",
            f"model.path={base_model}", f"dataset.path={data}", *TOOL_WARM_START_OVERRIDES]


def build_command(build_root: Path) -> list[str]:
    """The command that trains the default actor, with its run directory
    `<build_root>/default-actor/<WARM_START_VERSION>` (the module docstring's command)."""
    return [sys.executable, "-m", "realrl.apps.quickstart", "sft", f"output_root={build_root}",
            "experiment_name=default-actor", f"trial_name={WARM_START_VERSION}",
            *WARM_START_OVERRIDES]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(levelname)s %(message)s")
    print(ensure_tool_warm_start(use_packaged=False) if sys.argv[1:] == ["agent"]
          else ensure_warm_start(use_packaged=False))
