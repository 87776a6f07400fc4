"""`mode=slurm` against a real SLURM cluster (e.g. `tools/slurm-local.sh up` on localhost).

These drive the real CLI the way a user would, with real sbatch/srun, real model workers and
real task deaths (SIGKILL of one srun task). They skip when no SLURM cluster answers `sinfo`.
The cluster needs at least 2 CPU slots (SLURM_LOCAL_CPUS=8 is comfortable).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher_helpers import default_sigint


def _slurm_reachable() -> bool:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    try:
        result = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                                timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    states = result.stdout.split()
    return result.returncode == 0 and any(s.startswith(("idle", "mix", "alloc")) for s in states)


pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(not _slurm_reachable(), reason="no SLURM cluster reachable (sinfo)"),
]

CPU_JOB = ["mode=slurm", "slurm.gpu_request=none", "slurm.poll_interval_s=0.5",
           "n_devices_per_node=2", "wandb.mode=disabled", "tensorboard=false"]


def start_cli(tmp_path: Path, *args: str) -> subprocess.Popen:
    """The real CLI in the background; its stdout/stderr go to files in tmp_path."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "realrl.apps.quickstart", *args, f"output_root={tmp_path}"],
        cwd=tmp_path, env=env, stdout=open(tmp_path / "stdout.txt", "w"),
        stderr=open(tmp_path / "stderr.txt", "w"), preexec_fn=default_sigint,
    )


def finish(process: subprocess.Popen, tmp_path: Path, timeout_s: float) -> tuple[int, str, str]:
    try:
        returncode = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # the launcher then scancels its job
        process.wait(timeout=90)
        raise
    return (returncode, (tmp_path / "stdout.txt").read_text(),
            (tmp_path / "stderr.txt").read_text())


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def _environ(pid: str) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def entry_processes(run_dir: Path) -> dict[str, int]:
    """{"master" | "worker<R>": pid} of this run's live srun tasks on this machine."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if argv[1:3] != ["-m", "realrl.launcher.entry"] or str(run_dir) not in argv:
                continue
            env = _environ(pid)
        except (OSError, IndexError):
            continue
        if "SLURM_STEP_ID" in env:
            name = "master" if "master" in argv else f"worker{env['SLURM_PROCID']}"
            found[name] = int(pid)
    return found


def metric_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def job_listed(job_id: str) -> bool:
    result = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                            text=True)
    return result.returncode == 0 and bool(result.stdout.strip())


def submitted_job_ids(stdout: str) -> list[str]:
    return [line.split()[3] for line in stdout.splitlines()
            if line.startswith("submitted SLURM job")]


def test_a_killed_worker_ends_the_job_and_the_launcher_reports_its_log_tail(tmp_path):
    run_dir = tmp_path / "sft" / "trial0"
    process = start_cli(tmp_path, "sft", *CPU_JOB, "total_train_steps=2000")
    assert wait_until(lambda: len(metric_steps(run_dir)) >= 2, timeout_s=180), \
        (tmp_path / "stdout.txt").read_text()[-3000:]
    victim = entry_processes(run_dir)["worker1"]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    returncode, stdout, stderr = finish(process, tmp_path, timeout_s=60)
    assert returncode == 1
    assert time.monotonic() - killed_at < 30  # fail fast, not after a timeout
    assert "task 'worker1'" in stderr and "Killed" in stderr
    assert "worker 1 ready" in stderr  # from the tail of logs/worker1.log
    assert "last" in stderr and str(run_dir / "logs" / "worker1.log") in stderr
    (job_id,) = submitted_job_ids(stdout)
    assert not job_listed(job_id)
    assert wait_until(lambda: not entry_processes(run_dir), timeout_s=15)  # no task survives


def test_recover_mode_auto_resubmits_and_resumes_from_the_last_checkpoint(tmp_path):
    run_dir = tmp_path / "sft" / "trial0"
    process = start_cli(tmp_path, "sft", *CPU_JOB, "total_train_steps=40", "save_freq_steps=5",
                        "recover_mode=auto", "recover_retries=1")
    checkpoint = run_dir / "checkpoints" / "step000005" / "master.json"
    assert wait_until(checkpoint.is_file, timeout_s=180), (tmp_path / "stdout.txt").read_text()
    assert metric_steps(run_dir)[-1] < 40, "the run finished before the task could be killed"
    os.kill(entry_processes(run_dir)["worker0"], signal.SIGKILL)
    returncode, stdout, stderr = finish(process, tmp_path, timeout_s=240)
    assert returncode == 0, stderr[-3000:]
    assert len(submitted_job_ids(stdout)) == 2
    assert "task 'worker0'" in stderr and "resubmitting (retry 1 of 1)" in stderr
    assert (run_dir / "slurm" / "attempt2.sbatch").is_file()
    assert "resumed from" in (run_dir / "logs" / "master.log").read_text()
    assert metric_steps(run_dir)[-1] == 40


def test_ctrl_c_cancels_the_job(tmp_path):
    run_dir = tmp_path / "sft" / "trial0"
    process = start_cli(tmp_path, "sft", *CPU_JOB, "total_train_steps=2000")
    assert wait_until(lambda: "worker1" in entry_processes(run_dir), timeout_s=180)
    process.send_signal(signal.SIGINT)
    returncode, stdout, stderr = finish(process, tmp_path, timeout_s=90)
    assert returncode == 128 + signal.SIGINT
    (job_id,) = submitted_job_ids(stdout)
    assert f"cancelling SLURM job {job_id}" in stderr
    assert not job_listed(job_id)
    assert wait_until(lambda: not entry_processes(run_dir), timeout_s=15)


def _run_tree(run_dir: Path) -> set[str]:
    """Every path in the run directory except SLURM's own `slurm/` folder."""
    paths = {str(path.relative_to(run_dir)) for path in run_dir.rglob("*")}
    return {path for path in paths if path != "slurm" and not path.startswith("slurm/")}


def _plan_without_launch_keys(run_dir: Path) -> dict:
    """plan.json minus the keys that say where and how the run was launched."""
    plan = json.loads((run_dir / "plan.json").read_text())
    for key in ("mode", "slurm", "output_root"):
        plan["base"].pop(key)
    return plan


def _non_timing_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items()
             if not k.startswith(("timing/", "perf/"))
             and not k.endswith(("_per_s", "peak_memory_gb"))}  # measured, not computed
            for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["ppo-math"])
def test_two_step_run_under_slurm_writes_the_same_run_directory_as_local_mode(
        tmp_path, experiment):
    common = [experiment, "n_devices_per_node=2", "total_train_steps=2", "wandb.mode=disabled",
              "tensorboard=false"]
    local_root, slurm_root = tmp_path / "local", tmp_path / "slurm"
    local_root.mkdir()
    slurm_root.mkdir()
    local = finish(start_cli(local_root, *common), local_root, timeout_s=600)
    assert local[0] == 0, local[2][-3000:]
    on_slurm = finish(start_cli(slurm_root, *common, "mode=slurm", "slurm.gpu_request=none",
                                "slurm.poll_interval_s=0.5"), slurm_root, timeout_s=600)
    assert on_slurm[0] == 0, on_slurm[2][-3000:]
    local_dir, slurm_dir = (root / experiment / "trial0" for root in (local_root, slurm_root))
    assert _run_tree(slurm_dir) == _run_tree(local_dir)
    assert {p.name for p in (slurm_dir / "slurm").iterdir()} >= {"attempt1.sbatch"}
    assert _plan_without_launch_keys(slurm_dir) == _plan_without_launch_keys(local_dir)
    local_metrics, slurm_metrics = _non_timing_metrics(local_dir), _non_timing_metrics(slurm_dir)
    assert [row["step"] for row in slurm_metrics] == [1, 2]
    for slurm_row, local_row in zip(slurm_metrics, local_metrics, strict=True):
        assert sorted(slurm_row) == sorted(local_row)
        keys = sorted(local_row)  # same seed, layout and threads: the same numbers
        assert [slurm_row[k] for k in keys] == pytest.approx([local_row[k] for k in keys],
                                                             rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_usr1_before_the_time_limit_checkpoints_and_recover_mode_auto_resubmits(tmp_path):
    """`scancel --batch --signal=USR1` is what SLURM does `slurm.preempt_lead_s` seconds before
    the time limit (`#SBATCH --signal=B:USR1@N`). A job stopped with a newer checkpoint is
    resubmitted without using up a retry (`recover_retries=0`)."""
    run_dir = tmp_path / "sft" / "trial0"
    process = start_cli(tmp_path, "sft", *CPU_JOB, "total_train_steps=60", "recover_mode=auto",
                        "recover_retries=0")
    assert wait_until(lambda: len(metric_steps(run_dir)) >= 2, timeout_s=180), \
        (tmp_path / "stdout.txt").read_text()[-3000:]
    (first_job,) = submitted_job_ids((tmp_path / "stdout.txt").read_text())
    subprocess.run(["scancel", "--batch", "--signal=USR1", first_job], check=True, timeout=30)
    returncode, stdout, stderr = finish(process, tmp_path, timeout_s=400)
    assert returncode == 0, stderr[-3000:]
    assert len(submitted_job_ids(stdout)) == 2
    assert (f"SLURM job {first_job} stopped with a checkpoint (time limit or preemption); "
            "recover_mode=auto: resubmitting") in stderr
    job_output = (run_dir / "slurm" / f"job-{first_job}.out").read_text()
    assert "realrl: got SIGUSR1" in job_output
    assert "realrl: step master stopped with a checkpoint (preempted)" in job_output
    resumed = re.search(r"resumed from \S+/step(\d+) at step (\d+)",
                        (run_dir / "logs" / "master.log").read_text())
    assert resumed and 2 <= int(resumed[2]) < 60, "the job finished before the signal"
    assert metric_steps(run_dir) == list(range(1, 61))


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_the_job_with_a_checkpoint_and_names_the_resume_command(
        tmp_path):
    run_dir = tmp_path / "sft" / "trial0"
    process = start_cli(tmp_path, "sft", *CPU_JOB, "total_train_steps=2000", "recover_mode=auto")
    assert wait_until(lambda: len(metric_steps(run_dir)) >= 2, timeout_s=180), \
        (tmp_path / "stdout.txt").read_text()[-3000:]
    process.send_signal(signal.SIGTERM)
    returncode, stdout, stderr = finish(process, tmp_path, timeout_s=120)
    assert returncode == 75, stderr[-3000:]
    (job_id,) = submitted_job_ids(stdout)  # stopped by the user: not resubmitted
    assert f"asking SLURM job {job_id} to finish its step, write a checkpoint and stop" in stderr
    checkpoints = sorted((run_dir / "checkpoints").glob("step*"))
    assert [path.name for path in checkpoints] == [f"step{metric_steps(run_dir)[-1]:06d}"]
    assert f"SLURM job {job_id} stopped with checkpoint {checkpoints[-1]} (exit code 75)" in stderr
    resume = stderr.strip().splitlines()[-1]
    assert resume.startswith("resume with: ") and "sft mode=slurm" in resume
    assert resume.endswith(f"total_train_steps=2000 output_root={tmp_path} recover_mode=auto")
    assert not job_listed(job_id)
    assert wait_until(lambda: not entry_processes(run_dir), timeout_s=15)


@pytest.mark.slow
def test_async_rollouts_on_disjoint_two_worker_meshes_under_slurm(tmp_path):
    """`rollout.mode=async` in one SLURM job of 4 worker tasks: generation data-parallel on
    workers 0-1, training on workers 2-3, interruptible generation. Every step trains 4
    distinct prompts (2 responses each) within the staleness bound, every response's token
    versions never decrease and stay within it, and no task outlives the job."""
    eta, steps, batch_size = 2, 3, 4
    run_dir = tmp_path / "ppo-math" / "trial0"
    process = start_cli(
        tmp_path, "ppo-math", *CPU_JOB, "n_devices_per_node=4", f"total_train_steps={steps}",
        f"dataset.batch_size={batch_size}", "group_size=2", "gen.max_new_tokens=8",
        "ppo.disable_value=true", "ppo.adv_estimator=grpo",
        f"log.samples_per_step={2 * batch_size}", "log.samples_every_steps=1",
        "allocation_mode=actor_gen:d2@0-1,actor_train:d2@2-3,*:d2@0-1",
        "rollout.mode=async", f"rollout.max_head_offpolicyness={eta}",
        "rollout.groups_per_request=2", "rollout.decode_steps_per_chunk=1")
    returncode, stdout, stderr = finish(process, tmp_path, timeout_s=400)
    assert returncode == 0, stderr[-3000:]
    (job_id,) = submitted_job_ids(stdout)
    assert f"SLURM job {job_id} completed" in stdout
    assert {path.name for path in (run_dir / "logs").iterdir()} >= {
        "master.log", *(f"worker{rank}.log" for rank in range(4))}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in metrics] == list(range(1, steps + 1))
    for record in metrics:
        assert record["actor_train/num_sequences"] == 2 * batch_size
        assert record["async/token_staleness_max"] <= record["async/staleness_max"] <= eta
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == steps * 2 * batch_size
    for row in rows:
        versions = row["token_weight_versions"]
        assert versions == sorted(versions)
        assert row["step"] - 1 - eta <= versions[0] and versions[-1] <= row["step"] - 1
    assert len({row["query_id"] for row in rows}) == steps * batch_size
    assert not job_listed(job_id)
    assert wait_until(lambda: not entry_processes(run_dir), timeout_s=15)
