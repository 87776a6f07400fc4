"""What a master or model-worker process does differently when srun started it.

Why: under srun there is no supervisor handing each process its rank on the command line,
and the placement the launch plan promised (worker rank r on node r // n_devices_per_node,
device r % n_devices_per_node) is only as good as the `srun --distribution=block` that
produced it. A task therefore takes its rank from SLURM's environment and checks, before it
joins anything, that SLURM put it where the plan expects; a mismatch (say a site default of
`--distribution=cyclic` slipped in through `slurm.extra_srun_args`) stops the job with a message
instead of silently running a tensor-parallel group across nodes.

SLURM variables read here (all set by srun for each task):
    SLURM_PROCID    rank of the task within its step (= worker rank)
    SLURM_NODEID    index of the task's node within the job's allocation
    SLURM_LOCALID   index of the task among the step's tasks on its node (= device)
    SLURMD_NODENAME the node's name, for messages
"""

from __future__ import annotations

import logging
import os

from realrl.api.errors import UserFacingError

logger = logging.getLogger(__name__)


class PlacementError(UserFacingError):
    """SLURM placed a task somewhere other than where the launch plan expects it."""


def under_srun() -> bool:
    return "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ


def task_rank() -> int:
    """The worker rank of this task: its rank within the srun step."""
    value = os.environ.get("SLURM_PROCID")
    if value is None:
        raise PlacementError(
            "no --rank given and $SLURM_PROCID is unset: pass --rank when not started by srun"
        )
    return int(value)


def check_placement(rank: int, devices_per_node: int) -> int:
    """Verify that worker `rank` runs on node rank // D as local task rank % D; returns the
    device index. Raises `PlacementError` naming both placements when they differ."""
    expected_node, expected_device = divmod(rank, devices_per_node)
    node = int(os.environ.get("SLURM_NODEID", expected_node))
    device = int(os.environ.get("SLURM_LOCALID", expected_device))
    node_name = os.environ.get("SLURMD_NODENAME", "?")
    if (node, device) != (expected_node, expected_device):
        raise PlacementError(
            f"worker {rank} landed on node index {node} ({node_name}) as local task {device}, "
            f"but the launch plan puts it on node {expected_node}, device {expected_device}. "
            "The worker step must use `srun --distribution=block`; remove any "
            "--distribution/-m from slurm.extra_srun_args."
        )
    logger.info("worker %d on node %d (%s), device %d", rank, node, node_name, device)
    return device
