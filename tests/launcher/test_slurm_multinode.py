"""Multi-node placement on one machine: a private SLURM cluster of four named nodes.

Why this is a real multi-node test and where it stops: SLURM (Debian's build has
MULTIPLE_SLURMD) can run several slurmd daemons on one host, each a separate node
(`slurmd -N node1`) with its own port, all with NodeAddr 127.0.0.1. The scheduler, srun's task
distribution, `$SLURM_JOB_NODELIST`, `scontrol show hostnames`/`show node` and the per-node
step daemons are the real ones, so the rank -> node mapping, the master address lookup and
the rendezvous are exercised exactly as on a cluster. What one machine cannot show: separate
network stacks (every node is 127.0.0.1) and separate filesystems (the run directory is
shared). The cluster uses its own slurm.conf (via $SLURM_CONF) and ports, so it runs beside
`slurm-local.sh`'s cluster; it needs root, the SLURM daemons and a running munged (which
`slurm-local.sh up` starts), and is skipped otherwise.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

NODES = ["node0", "node1", "node2", "node3"]
CPU_JOB = ["mode=slurm", "slurm.gpu_request=none", "slurm.poll_interval_s=0.5",
           "wandb.mode=disabled", "tensorboard=false"]


def _prerequisites_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root to run slurmctld/slurmd"
    for tool in ("slurmctld", "slurmd", "sbatch", "munge"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"`{tool}` is not installed"
    if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
        return "munged is not running (start it with slurm-local.sh up)"
    return None


pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(_prerequisites_missing() is not None,
                       reason=f"no private SLURM cluster: {_prerequisites_missing()}"),
]


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for probe in sockets:
        probe.bind(("127.0.0.1", 0))
    ports = [probe.getsockname()[1] for probe in sockets]
    for probe in sockets:
        probe.close()
    return ports


def _slurm_conf(state: Path, controller_port: int, node_ports: list[int]) -> str:
    nodes = "\n".join(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
                      f"CPUs=2 RealMemory=2000 State=UNKNOWN"
                      for name, port in zip(NODES, node_ports))
    return f"""\
ClusterName=realrltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={controller_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool-%n
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd-%n.log
{nodes}
PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def four_node_cluster(tmp_path_factory):
    """Environment (with $SLURM_CONF) of a running four-node cluster; stopped afterwards."""
    state = tmp_path_factory.mktemp("cluster")
    (state / "ctld").mkdir()
    controller_port, *node_ports = _free_ports(1 + len(NODES))
    conf = state / "slurm.conf"
    conf.write_text(_slurm_conf(state, controller_port, node_ports))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [subprocess.Popen(["slurmctld", "-D", "-c", "-f", str(conf)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    for name in NODES:
        (state / f"spool-{name}").mkdir()
        daemons.append(subprocess.Popen(["slurmd", "-D", "-N", name, "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        deadline, states = time.monotonic() + 30, ""
        while time.monotonic() < deadline:
            states = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, text=True,
                                    capture_output=True, timeout=10).stdout
            if states.split() == ["idle"] * len(NODES):
                break
            time.sleep(0.3)
        else:
            pytest.skip(f"private four-node cluster did not come up (node states: {states!r})")
        yield env
    finally:
        for daemon in reversed(daemons):
            daemon.send_signal(signal.SIGTERM)
        for daemon in reversed(daemons):
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def run_cli(env: dict, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "realrl.apps.quickstart", *args, f"output_root={tmp_path}"],
        cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300,
    )


def test_ranks_land_in_blocks_and_an_mfc_on_the_second_node_trains_there(
        four_node_cluster, tmp_path):
    # 2 nodes x 2 workers; the only MFC runs on ranks 2-3, i.e. on the second node only.
    result = run_cli(four_node_cluster, tmp_path, "sft", *CPU_JOB, "n_nodes=2",
                     "n_devices_per_node=2", "allocation_mode=trainDefault:d2@2-3",
                     "total_train_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "sft" / "trial0"
    (job_output,) = (run_dir / "slurm").glob("job-*.out")
    assert re.search(r"master on node\d, store 127\.0\.0\.1:\d+", job_output.read_text())
    nodes_used = set()
    for rank in range(4):
        log = (run_dir / "logs" / f"worker{rank}.log").read_text()
        placement = re.search(r"worker (\d) on node (\d) \((node\d)\), device (\d)", log)
        assert placement, log[-2000:]
        assert placement.groups()[:2] == (str(rank), str(rank // 2))
        assert placement[4] == str(rank % 2)
        nodes_used.add((rank // 2, placement[3]))
        assert ("hosting default@2,3" in log) == (rank >= 2)
    assert len({name for _, name in nodes_used}) == 2  # two distinct SLURM nodes
    assert (run_dir / "checkpoints" / "step000002").is_dir()


def test_a_cyclic_distribution_is_caught_by_the_placement_check(four_node_cluster, tmp_path):
    result = run_cli(four_node_cluster, tmp_path, "sft", *CPU_JOB, "n_nodes=2",
                     "n_devices_per_node=2", "slurm.extra_srun_args=['--distribution=cyclic']",
                     "total_train_steps=2")
    assert result.returncode == 1
    assert re.search(r"task 'worker[12]' on node node[01]", result.stderr), result.stderr
    assert "but the launch plan puts it on node" in result.stderr
    assert "--distribution=block" in result.stderr
