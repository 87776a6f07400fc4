"""The generated sbatch script and srun steps, and reading a failed job: no cluster needed."""

import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest

from realrl.api.config import ConfigError, resolve_config
from realrl.experiments.sft import SFTExperimentConfig
from realrl.launcher.processes import LOG_ONLY_PREFIX
from realrl.launcher.slurm import (
    JobStatus,
    _LogFollower,
    describe_dry_run,
    describe_failure,
    find_failed_task,
)
from realrl.launcher.slurm_script import (
    SlurmJob,
    master_srun,
    render_batch_script,
    sbatch_options,
    worker_srun,
    write_batch_script,
)
from realrl.launcher.slurm_task import PlacementError, check_placement

FOUR_BY_EIGHT = [
    "mode=slurm", "n_nodes=4", "n_devices_per_node=8", "slurm.partition=gpu",
    "slurm.account=proj7", "slurm.qos=high", "slurm.time_limit='2-00:00:00'",
    "slurm.exclusive=true", "slurm.nodelist='gpu[01-04]'", "slurm.exclude=gpu09",
    "slurm.cpus_per_task=12", "slurm.mem_per_task_mb=64000",
    "slurm.extra_sbatch_args=['--requeue']", "slurm.extra_srun_args=['--mpi=none']",
    "slurm.env.NCCL_DEBUG=INFO",
]


def _config(tmp_path, *overrides):
    # A cluster job states its devices per node (detection only works locally); overrides win.
    return resolve_config(SFTExperimentConfig,
                          [f"output_root={tmp_path}", "n_devices_per_node=1", *overrides],
                          defaults={"experiment_name": "sft"})


def _options(tokens):
    """`--key=value` tokens of a command as a dict (flags map to True)."""
    found = {}
    for token in tokens:
        if token.startswith("--"):
            key, _, value = token.partition("=")
            found[key] = value or True
    return found


def test_four_node_eight_gpu_job_asks_for_every_configured_sbatch_option(tmp_path):
    config = _config(tmp_path, *FOUR_BY_EIGHT)
    options = sbatch_options(config)
    expected = {
        "--nodes": "4", "--ntasks-per-node": "8", "--cpus-per-task": "12",
        "--mem": "512000M",  # 8 tasks x 64000 MB per node
        "--gres": "gpu:8", "--partition": "gpu", "--account": "proj7", "--qos": "high",
        "--time": "2-00:00:00", "--exclusive": True, "--nodelist": "gpu[01-04]",
        "--exclude": "gpu09", "--requeue": True, "--job-name": "realrl-sft-trial0",
        "--output": f"{tmp_path.resolve()}/sft/trial0/slurm/job-%j.out",
    }
    assert {key: _options(options)[key] for key in expected} == expected
    assert options[-1] == "--requeue"  # extra arguments come last so they can override


def test_gpus_request_kind_uses_gpus_per_node_and_none_requests_no_gpu(tmp_path):
    gpus = _options(sbatch_options(_config(tmp_path, *FOUR_BY_EIGHT, "slurm.gpu_request=gpus")))
    assert gpus["--gpus-per-node"] == "8" and "--gres" not in gpus
    cpu_only = _options(sbatch_options(_config(tmp_path, "mode=slurm", "slurm.gpu_request=none")))
    assert "--gres" not in cpu_only and "--gpus-per-node" not in cpu_only


def test_worker_step_places_thirty_two_ranks_in_blocks_of_eight(tmp_path):
    tokens = worker_srun(_config(tmp_path, *FOUR_BY_EIGHT))
    options = _options(tokens)
    assert options["--nodes"] == "4" and options["--ntasks"] == "32"
    assert options["--ntasks-per-node"] == "8" and options["--distribution"] == "block"
    assert options["--kill-on-bad-exit"] == "1" and options["--mpi"] == "none"
    assert options["--output"] == f"{tmp_path.resolve()}/sft/trial0/logs/worker%t.log"
    assert tokens[-3:] == ["worker", "--devices-per-node", "8"]
    assert "--rank" not in tokens  # the rank is $SLURM_PROCID


def test_master_step_runs_one_overlapping_task_on_the_first_node(tmp_path):
    tokens = master_srun(_config(tmp_path, *FOUR_BY_EIGHT))
    options = _options(tokens)
    assert options["--nodes"] == "1" and options["--ntasks"] == "1"
    assert options["--nodelist"] == '"$MASTER_NODE"' and options["--overlap"] is True
    assert options["--output"].endswith("/sft/trial0/logs/master.log")
    assert tokens[-1] == "master" and "--world-size" in tokens
    assert tokens[tokens.index("--world-size") + 1] == "32"


def test_script_exports_secret_and_environment_and_embeds_the_plan(tmp_path):
    config = _config(tmp_path, *FOUR_BY_EIGHT)
    script = render_batch_script(config, SlurmJob(2, 41234, "ab" * 32, '{"plan": 1}\n'))
    assert f"export REALRL_RUN_SECRET={'ab' * 32}" in script
    assert "export NCCL_DEBUG=INFO" in script
    assert "<<'REALRL_PLAN_JSON'\n{\"plan\": 1}\nREALRL_PLAN_JSON\n)\" > " in script
    assert 'export REALRL_STORE="${MASTER_ADDR:-$MASTER_NODE}:41234"' in script
    assert "scontrol show hostnames \"$SLURM_JOB_NODELIST\"" in script
    assert "WORKER_CPUS=12\n" in script and "OMP_NUM_THREADS=\"$WORKER_CPUS\"" in script
    assert "attempt 2" in script.splitlines()[1]


def test_script_parses_as_bash_and_writes_the_plan_byte_for_byte(tmp_path):
    config = _config(tmp_path, *FOUR_BY_EIGHT)
    plan_json = '{\n "quote": "it\'s $HOME `x`",\n "n": 1\n}'
    script = render_batch_script(config, SlurmJob(1, 4000, "00" * 32, plan_json))
    result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "sft" / "trial0"
    prologue = script.split("# Rendezvous:")[0]  # exports and the plan, nothing SLURM-only
    subprocess.run(["bash", "-c", prologue], check=True)
    assert (run_dir / "plan.json").read_text() == plan_json


def test_script_file_is_owner_only(tmp_path):
    path = write_batch_script(_config(tmp_path, "mode=slurm"), SlurmJob(1, 4000, "11" * 32, "{}"))
    assert path.name == "attempt1.sbatch"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_pyxis_and_singularity_wrap_both_steps(tmp_path):
    pyxis = master_srun(_config(tmp_path, "mode=slurm", "slurm.container_image=nvcr.io/x:1"))
    assert "--container-image=nvcr.io/x:1" in pyxis and "python3" in pyxis
    singularity = worker_srun(_config(tmp_path, "mode=slurm", "slurm.singularity_image=img.sif"))
    start = singularity.index("singularity")
    assert singularity[start:start + 3] == ["singularity", "exec", "--nv"]
    assert singularity[singularity.index("img.sif") + 1] == "python3"


def test_conflicting_or_unknown_slurm_keys_are_reported_together(tmp_path):
    config = _config(tmp_path, "mode=slurm", "slurm.gpu_request=gpu", "slurm.container_image=a",
                     "slurm.singularity_image=b")
    with pytest.raises(ConfigError) as error:
        describe_dry_run(config)
    assert "slurm.gpu_request=gpu" in str(error.value) and "at most one" in str(error.value)


def test_dry_run_prints_script_and_srun_commands_and_submits_nothing(tmp_path):
    # A machine without SLURM's commands: the dry run cannot ask a cluster (sinfo, `sbatch
    # --test-only`; `test_slurm_checks.py` does), so it prints the script for GPU nodes.
    without_slurm = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    result = subprocess.run(
        [sys.executable, "-m", "realrl.apps.quickstart", "sft", "--dry-run", *FOUR_BY_EIGHT,
         f"output_root={tmp_path}"], capture_output=True, text=True, timeout=120,
        env=without_slurm)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "#SBATCH --nodes=4" in out and "#SBATCH --gres=gpu:8" in out
    assert re.search(r"^workers: srun .*--ntasks=32 .*--distribution=block", out, re.MULTILINE)
    assert re.search(r"^master:  srun .*--overlap", out, re.MULTILINE)
    assert "written at submission" in out  # the secret is never printed
    assert not (tmp_path / "sft").exists()


def test_failed_task_is_the_first_one_srun_reports_for_the_failed_step():
    job_output = ("realrl: job 7 on node[0-1]; master on node0\n"
                  "realrl: step workers failed with exit code 137; ending the job\n")
    srun_messages = {"workers": "srun: error: node1: task 3: Killed\n"
                                "srun: launch/slurm: _step_signal: Terminating StepId=7.2\n"
                                "srun: error: node0: tasks 0-1: Terminated\n"}
    failed = find_failed_task(job_output, srun_messages)
    assert (failed.name, failed.node, failed.how) == ("worker3", "node1", "Killed")
    master = find_failed_task("realrl: step master failed with exit code 1\n",
                              {"master": "srun: error: node0: task 0: Exited with exit code 1\n"})
    assert (master.name, master.how) == ("master", "Exited with exit code 1")
    assert find_failed_task("realrl: all steps finished\n", {}) is None


def test_the_log_only_traceback_of_a_user_facing_error_is_neither_followed_nor_reported(
    tmp_path, capsys
):
    config = _config(tmp_path, "mode=slurm")
    logs, slurm_dir = config.run_dir / "logs", config.run_dir / "slurm"
    logs.mkdir(parents=True)
    slurm_dir.mkdir()
    (slurm_dir / "job-7.out").write_text("realrl: step master failed with exit code 1\n")
    (slurm_dir / "job-7-master.srun").write_text(
        "srun: error: node0: task 0: Exited with exit code 1\n")
    follower = _LogFollower(logs / "master.log", "[master]")
    (logs / "master.log").write_text(
        "12:00:01 INFO realrl.workers.master_main: all 2 workers ready\n"
        "12:00:02 ERROR realrl.launcher.entry: stopping the run: worker 1: NonFiniteError: ...\n"
        f"{LOG_ONLY_PREFIX}Traceback (most recent call last):\n"
        f"{LOG_ONLY_PREFIX}realrl.workers.wire.RemoteUserFacingError: worker 1: ...\n")
    follower.poll()
    followed = capsys.readouterr().out
    assert "[master] 12:00:02 ERROR realrl.launcher.entry: stopping the run: worker 1" in followed
    assert "Traceback" not in followed
    report = describe_failure(config, "7", JobStatus("FAILED", "1:0"))
    assert "task 'master' on node node0" in report and "stopping the run: worker 1" in report
    assert "Traceback" not in report and "last 2 lines of" in report


def test_when_both_steps_have_failed_the_job_reports_the_workers_step(tmp_path):
    # A killed worker makes the master fail too, often before the script's next check (a CI
    # run reported the master): the worker is the cause.
    job = SlurmJob(1, 4000, "22" * 32, "{}")
    script = render_batch_script(_config(tmp_path, "mode=slurm"), job)
    supervise = script[script.index("# End the job as soon as either step fails"):]
    steps = "(exit 1) & MASTER_PID=$!\n(exit 137) & WORKERS_PID=$!\nsleep 0.3\n"
    result = subprocess.run(["bash", "-c", steps + supervise], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 137
    assert result.stdout == "realrl: step workers failed with exit code 137; ending the job\n"


def test_placement_check_rejects_a_cyclic_layout(monkeypatch):
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert check_placement(rank=3, devices_per_node=2) == 1  # block: rank 3 -> node 1, dev 1
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_LOCALID", "0")  # cyclic would put rank 1 here
    with pytest.raises(PlacementError, match="node 0, device 1"):
        check_placement(rank=1, devices_per_node=2)


def test_the_job_asks_for_usr1_ahead_of_its_time_limit_unless_the_lead_is_zero(tmp_path):
    assert "--signal=B:USR1@300" in sbatch_options(_config(tmp_path, "mode=slurm"))
    assert "--signal=B:USR1@900" in sbatch_options(
        _config(tmp_path, "mode=slurm", "slurm.preempt_lead_s=900"))
    assert not any(option.startswith("--signal") for option in sbatch_options(
        _config(tmp_path, "mode=slurm", "slurm.preempt_lead_s=0")))
    with pytest.raises(ConfigError, match=r"slurm.preempt_lead_s=70000` must be between 0"):
        describe_dry_run(_config(tmp_path, "mode=slurm", "slurm.preempt_lead_s=70000"))


def test_usr1_to_the_script_reaches_the_master_step_and_its_exit_75_ends_the_job(tmp_path):
    """The script's trap and step watch in bash, with stand-ins for the two srun steps: the
    master step stops with 75 on USR1 (as srun forwards it to the master), the workers run on."""
    script = render_batch_script(_config(tmp_path, "mode=slurm"), SlurmJob(1, 4000, "22" * 32, "{}"))
    trap = script[script.index('PREEMPT_ASKED=""'):script.index("# Rendezvous")]
    supervise = script[script.index('if [ -n "$PREEMPT_ASKED" ]'):]
    steps = ("(trap 'exit 75' USR1; touch master_ready; while :; do sleep 0.05; done) & "
             "MASTER_PID=$!\n(sleep 5) & WORKERS_PID=$!\n")
    batch = subprocess.Popen(["bash", "-c", trap + steps + supervise], cwd=tmp_path,
                             stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "master_ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        batch.send_signal(signal.SIGUSR1)  # what `--signal=B:USR1@N` does before the time limit
        assert batch.wait(timeout=10) == 75
    finally:
        batch.kill()
        batch.wait()
    assert batch.stdout.read().splitlines() == [
        "realrl: got SIGUSR1 (time limit or preemption ahead): asking the master to checkpoint",
        "realrl: step master stopped with a checkpoint (preempted); ending the job",
    ]

