"""The soak benchmark: its trend arithmetic, its process naming, and a short real run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

from soak import role_name  # noqa: E402
from soak_summary import PROCESS_QUANTITIES, fit_line, is_growing, summarise  # noqa: E402

from realrl.launcher.defaults import fresh_default_model  # noqa: E402


def test_fit_line_gives_the_slope_per_1000_steps_and_no_scatter_on_a_straight_line():
    fit = fit_line([0.0, 1000.0, 2000.0, 3000.0], [10.0, 12.0, 14.0, 16.0])
    assert fit["slope_per_1000_steps"] == pytest.approx(2.0)
    assert fit["rise"] == pytest.approx(6.0)  # 2 per 1000 steps over 3000 steps
    assert fit["residual_std"] == pytest.approx(0.0, abs=1e-12)
    assert is_growing(fit, "rss_mib")


def test_fit_line_noise_of_a_hand_computed_case():
    # Steps 0, 1, 2, 3 (mean 1.5, spread 5), values 0, 2, 1, 3 (mean 1.5): slope
    # (-1.5*-1.5 + -0.5*0.5 + 0.5*-0.5 + 1.5*1.5) / 5 = 4 / 5 = 0.8, intercept 0.3;
    # residuals -0.3, 0.9, -0.9, 0.3: sum of squares 1.8, / (4 - 2) = 0.9.
    fit = fit_line([0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 1.0, 3.0])
    assert fit["slope_per_1000_steps"] == pytest.approx(800.0)
    assert fit["residual_std"] == pytest.approx(0.9**0.5)
    assert fit["slope_stderr"] == pytest.approx(1000 * (0.9 / 5) ** 0.5)
    # Rise 2.4 over the window: above 2 x 0.949 scatter, but not above 3 standard errors
    # (3 x 0.424 x 3 steps = 3.82), so four noisy points are not called a leak.
    assert not is_growing(fit, "rss_mib")


def test_scatter_around_a_flat_line_and_a_fraction_of_one_fd_are_not_growth():
    steps = [float(step) for step in range(0, 2000, 50)]
    sawtooth = [300.0 + (index % 4) for index in range(len(steps))]
    assert not is_growing(fit_line(steps, sawtooth), "rss_mib")
    # One more fd for the last two samples: a fitted rise under one whole fd.
    fds = [29.0] * (len(steps) - 2) + [30.0, 30.0]
    fit = fit_line(steps, fds)
    assert fit["rise"] < 1.0 and not is_growing(fit, "fds")


def test_a_memory_slope_under_the_floor_is_not_growth_however_steady():
    steps = [float(step) for step in range(0, 2500, 50)]
    creeping = [400.0 + 0.05 * step / 1000 for step in steps]  # 0.05 MiB per 1000 steps
    fit = fit_line(steps, creeping)
    assert fit["slope_per_1000_steps"] == pytest.approx(0.05)
    assert not is_growing(fit, "rss_mib")
    assert is_growing(fit, "rss_mib", min_slope_mib=0.01)


def test_fit_line_needs_four_points_on_more_than_one_step():
    assert fit_line([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) is None
    assert fit_line([5.0] * 6, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) is None


def _sample(step: int, leaking_fds: int, rss_mib: float) -> dict:
    flat = {"pid": 11, "rss_mib": 300.0, "anon_mib": 200.0, "shmem_mib": 0.0, "fds": 20,
            "sockets": 4, "threads": 8, "shm_mib": 0.0}
    return {"step": step, "step_s": 0.2, "run_shm_mib": 9.0, "run_shm_segments": 4,
            "run_shm_named_files": 0, "dev_shm_used_mib": 9.0,
            "processes": {"master": flat,
                          "worker0": flat | {"pid": 12, "fds": leaking_fds, "rss_mib": rss_mib}}}


def test_summarise_flags_only_the_leaking_series_of_the_second_half():
    # worker0 opens one fd every 100 steps; its RSS jumps at the last step (the final
    # checkpoint), which lies outside the fitted window and only shows in the peak.
    samples = [_sample(step, 20 + step // 100, 400.0) for step in range(0, 1000, 20)]
    samples.append(_sample(1000, 30, 900.0))
    summary = summarise({"steps": 1000, "samples": samples})
    assert summary["growing"] == ["worker0 fds"]
    worker = summary["processes"]["worker0"]
    assert worker["fds"]["fit"]["slope_per_1000_steps"] == pytest.approx(10.0, rel=0.05)
    assert worker["fds"]["fit"]["window_steps"] == [500.0, 980.0]
    assert worker["rss_mib"]["peak"] == 900.0 and not worker["rss_mib"]["growing"]
    assert worker["pids"] == [12]
    assert set(summary["machine"]) >= {"run_shm_mib", "run_shm_segments", "step_s"}


def test_role_names_follow_realrls_processes_and_their_children():
    entry = ["/venv/bin/python", "-m", "realrl.launcher.entry", "--run-dir", "/r", "--store",
             "127.0.0.1:1", "--world-size", "2"]
    assert role_name(entry + ["master"], "launcher") == "master"
    assert role_name(entry + ["worker", "--rank", "1"], "launcher") == "worker1"
    verifier = ["/venv/bin/python", "-I", "/src/realrl/rewards/_math_worker.py", "4096", "[]"]
    assert role_name(verifier, "worker1") == "worker1/math_worker"
    assert role_name(["/usr/bin/wandb-core", "--port"], "master") == "master/wandb-core"
    server = ["/venv/bin/python", "-m", "realrl.launcher.forkserver", "5", "--for", "/r"]
    assert role_name(server, "launcher", "python") == "fork_server"
    assert role_name(server, "fork_server", "realrl-worker1") == "worker1"
    assert role_name(server, "fork_server", "realrl-master") == "master"


def test_soak_script_runs_a_short_ppo_math_and_writes_samples_and_summary(tmp_path):
    model = fresh_default_model(tmp_path / "model")
    output = tmp_path / "soak.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "REALRL_CACHE": str(tmp_path / "cache")}
    completed = subprocess.run(
        [sys.executable, str(BENCH_DIR / "soak.py"), "--steps", "2", "--interval", "0.3",
         "--output", str(output), "--work-dir", str(tmp_path / "runs"), f"actor.path={model}",
         "dataset.batch_size=2", "group_size=2", "gen.max_new_tokens=4", "n_devices_per_node=1",
         "wandb.mode=disabled", "tensorboard=false"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["returncode"] == 0 and result["final_step"] == 2
    assert result["orphans"] == [] and result["realrl_shm_files_left"] == []
    seen = {name for sample in result["samples"] for name in sample["processes"]}
    assert {"launcher", "master", "worker0"} <= seen
    master = max((s["processes"]["master"] for s in result["samples"] if "master" in s["processes"]),
                 key=lambda quantities: quantities["rss_mib"])
    assert set(PROCESS_QUANTITIES) | {"pid"} <= set(master)
    assert master["rss_mib"] > 50 and master["threads"] >= 1 and master["fds"] >= 3
    summary = result["summary"]
    assert summary["processes"]["master"]["rss_mib"]["peak"] >= master["rss_mib"]
    assert "| master (pids 1) | rss_mib |" in completed.stdout
    assert "growth beyond noise:" in completed.stdout
