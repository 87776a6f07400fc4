"""What the SLURM cluster says about a job before it is submitted.

- `slurm.gpu_request=auto` becomes `gres` when `sinfo` lists a GPU GRES on the job's
  partition (all partitions when none is set), else `none`: on a CPU-only cluster
  `--gres=gpu:N` makes sbatch fail with "Invalid generic resource (gres) specification".
- `sbatch --test-only` validates the rendered script against the cluster (partition, GRES,
  tasks per node, memory, account) without submitting anything; a refusal becomes one
  problem with the fix (`sbatch_fix`). `--dry-run` and a real start both run it; a machine
  without SLURM's commands skips both checks (the dry run says so).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from realrl.api.config import BaseExperimentConfig
from realrl.launcher.slurm_script import SlurmJob, render_batch_script

logger = logging.getLogger(__name__)

SLURM_QUERY_TIMEOUT_S = 30
# sbatch's words -> what to change; the first matching pattern wins.
SBATCH_FIXES = [
    (re.compile(r"contact slurm controller|Socket timed out", re.IGNORECASE),
     "the SLURM controller did not answer: check `scontrol ping` and `sinfo`, then retry"),
    (re.compile(r"generic resource|gres", re.IGNORECASE),
     "the nodes have no GPU GRES: set `slurm.gpu_request=none` for CPU-only nodes (or auto, "
     "which asks sinfo), or `slurm.gpu_request=gpus` where GPUs are requested with --gpus"),
    (re.compile(r"partition", re.IGNORECASE),
     "set `slurm.partition` to one that `sinfo -s` lists (null: the cluster's default)"),
    (re.compile(r"account|association", re.IGNORECASE),
     "set `slurm.account` (and `slurm.qos`) to ones you may use (`sacctmgr show assoc user=$USER`)"),
    (re.compile(r"node configuration is not available|more processors|Requested node",
                re.IGNORECASE),
     "no node has what one node of the job asks for: lower `n_devices_per_node` (tasks per "
     "node), `slurm.cpus_per_task` or `slurm.mem_per_task_mb`, or check `sinfo -N -l`"),
    (re.compile(r"time limit", re.IGNORECASE),
     "lower `slurm.time_limit` to the partition's limit (`sinfo -o '%P %l'`)"),
]


def have_slurm_commands() -> bool:
    return shutil.which("sinfo") is not None and shutil.which("sbatch") is not None


def sbatch_fix(message: str) -> str:
    """The fix line for an sbatch error message (a generic pointer where none matches)."""
    for pattern, fix in SBATCH_FIXES:
        if pattern.search(message):
            return f"fix: {fix}"
    return "fix: see the `slurm.*` keys (`--help`) and docs/slurm.md; `--dry-run` checks them"


def lists_gpu_gres(sinfo_gres: str) -> bool:
    """Whether `sinfo -h -o %G` output names a GPU GRES on any line, e.g. `gpu:8`,
    `gpu:a100:4(S:0-1)` or `gpu:2,shard:8` (a CPU node shows `(null)`)."""
    return any(re.search(r"(^|,)gpu(:|$)", line.strip()) for line in sinfo_gres.splitlines())


def detected_gpu_request(partition: str | None) -> str:
    """`gres` when sinfo lists a GPU GRES on `partition`'s nodes (any partition's for None),
    else `none`; `gres` where sinfo is missing or fails (the old default)."""
    if shutil.which("sinfo") is None:
        logger.info("slurm.gpu_request=auto: sinfo is not on PATH, assuming GPU nodes (gres)")
        return "gres"
    command = ["sinfo", "-h", "-o", "%G"] + (["-p", partition] if partition else [])
    try:
        result = subprocess.run(command, capture_output=True, text=True,
                                timeout=SLURM_QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("slurm.gpu_request=auto: `%s` failed (%s); assuming gres",
                       " ".join(command), error)
        return "gres"
    if result.returncode != 0:
        logger.warning("slurm.gpu_request=auto: `%s` failed: %s; assuming gres",
                       " ".join(command), result.stderr.strip())
        return "gres"
    has_gpus = lists_gpu_gres(result.stdout)
    request = "gres" if has_gpus else "none"
    logger.info("slurm.gpu_request=auto: sinfo lists %s GPU GRES%s: %s", "a" if has_gpus else "no",
                f" on partition {partition}" if partition else "", request)
    return request


def resolve_gpu_request(config: BaseExperimentConfig) -> None:
    """Replace `slurm.gpu_request=auto` with what the cluster has (see module docstring)."""
    if config.slurm.gpu_request == "auto":
        config.slurm.gpu_request = detected_gpu_request(config.slurm.partition)


def submission_problems(config: BaseExperimentConfig) -> list[str]:
    """`sbatch --test-only` of the job's script: [] when SLURM would accept it, else one
    problem quoting sbatch and naming the fix. Skipped without SLURM's commands."""
    if not have_slurm_commands():
        logger.warning("sinfo or sbatch is not on PATH: the job is not checked against a "
                       "cluster (`sbatch --test-only`)")
        return []
    script = render_batch_script(config, SlurmJob(1, None, None, None))
    with tempfile.TemporaryDirectory(prefix="realrl-sbatch-") as directory:
        path = Path(directory) / "test.sbatch"
        path.write_text(script)
        try:
            result = subprocess.run(["sbatch", "--test-only", str(path)], capture_output=True,
                                    text=True, timeout=SLURM_QUERY_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as error:
            logger.warning("`sbatch --test-only` failed (%s); the job is not checked", error)
            return []
    if result.returncode == 0:
        return []
    said = " ".join(line.strip() for line in result.stderr.splitlines()
                    if "error" in line or "failure" in line) or result.stderr.strip()
    return [f"SLURM refuses this job (`sbatch --test-only`): {said}; {sbatch_fix(said)}"]
