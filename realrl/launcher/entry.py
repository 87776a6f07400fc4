"""Process entry point of the master and the model workers (the launcher starts these).

    python -m realrl.launcher.entry --run-dir DIR --store HOST:PORT --world-size N master
    python -m realrl.launcher.entry --run-dir DIR --store HOST:PORT --world-size N worker --rank R

The master hosts the rendezvous store at HOST:PORT; workers connect to it. Under srun a worker
omits --rank (it is $SLURM_PROCID) and passes --devices-per-node D, so that it can check its
placement against the launch plan (see `realrl.launcher.slurm_task`). The master takes SIGUSR1 as
a request to checkpoint and stop, from its first line on; workers ignore it
(`realrl.workers.preemption`).

A process that stops on an error written for the user (`realrl.api.errors.UserFacingError`,
including a worker's, which the master receives as `RemoteUserFacingError`) logs its message as
one ERROR line and exits 1; its traceback goes to the log file only (`install_worker_logging`
marks it, the launcher keeps it off the console). Any other error keeps Python's traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from realrl.api.errors import UserFacingError
from realrl.launcher.processes import apply_thread_limit, install_worker_logging, watch_parent
from realrl.workers.preemption import PreemptionRequest, ignore_preemption_signal

logger = logging.getLogger("realrl.launcher.entry")  # not __name__: run as __main__


def main(argv: list[str] | None = None) -> int:
    args = _parse_arguments(argv)
    preemption = PreemptionRequest()
    if args.role == "master":
        preemption.install()  # first: a stop asked for during start-up is kept for later
    else:
        ignore_preemption_signal()

    install_worker_logging()
    apply_thread_limit()
    if not args.no_watch_parent:
        watch_parent()
    try:
        return _run_role(args, preemption)
    except UserFacingError as error:
        logger.error("stopping the run: %s", error, exc_info=error)
        return 1


def _parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m realrl.launcher.entry")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--store", required=True, help="HOST:PORT of the rendezvous store")
    parser.add_argument("--world-size", required=True, type=int)
    parser.add_argument("--no-watch-parent", action="store_true",
                        help="under srun the parent is slurmstepd; SLURM cleans up instead")
    sub = parser.add_subparsers(dest="role", required=True)
    sub.add_parser("master")
    worker = sub.add_parser("worker")
    worker.add_argument("--rank", type=int, help="default: $SLURM_PROCID (under srun)")
    worker.add_argument("--devices-per-node", type=int,
                        help="under srun: check rank -> (node, device) placement against it")
    return parser.parse_args(argv)


def _run_role(args: argparse.Namespace, preemption: PreemptionRequest) -> int:
    host, port = args.store.rsplit(":", 1)
    from realrl.workers.rendezvous import Rendezvous

    if args.role == "master":
        from realrl.workers.master_main import run_master

        rendezvous = Rendezvous(host, int(port), is_host=True)
        return run_master(args.run_dir, rendezvous, args.world_size, preemption)
    from realrl.backends.worker_device import bind_device
    from realrl.launcher import slurm_task
    from realrl.workers.model_worker import serve

    rank = args.rank if args.rank is not None else slurm_task.task_rank()
    if args.devices_per_node is not None and slurm_task.under_srun():
        bind_device(slurm_task.check_placement(rank, args.devices_per_node))
    else:  # local: worker r uses GPU r of this machine (no-op without GPUs)
        bind_device(rank)
    rendezvous = Rendezvous(host, int(port), is_host=False)
    serve(rendezvous, rank, args.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
