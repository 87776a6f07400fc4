"""`allocation_mode=search` as a user meets it: `--dry-run` of a local run on this CPU and of
a SLURM run on GPU nodes, through the real CLI (issue 27)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

QUICKSTART = [sys.executable, "-m", "realrl.apps.quickstart"]


def dry_run(tmp_path, *overrides, env=None):
    environment = {**os.environ, "REALRL_CACHE": str(tmp_path / "cache"), **(env or {})}
    return subprocess.run([*QUICKSTART, "ppo-math", "--dry-run", "allocation_mode=search",
                           f"output_root={tmp_path / 'runs'}", *overrides],
                          capture_output=True, text=True, timeout=300, env=environment)


def allocation_table(out: str) -> dict[str, tuple[str, str]]:
    """MFC -> (ranks, layout) from the dry run's `# allocations` table."""
    table = out.split("# allocations\n", 1)[1].split("\n\n", 1)[0]
    return {line.split()[0]: (line.split()[1], line.split()[2])
            for line in table.splitlines()[1:]}


def test_a_local_dry_run_searches_once_prints_the_plans_and_allocates_the_best(tmp_path):
    result = dry_run(tmp_path, "n_devices_per_node=2")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "# plan search (allocation_mode=search)" in out
    assert "device: cpu (1 thread(s), measured)" in out and "why #2 lost" in out
    best = re.search(r"#1: [\d.]+ s per step.*\n  allocation_mode='([^']+)'", out).group(1)
    chosen = {entry.split(":")[0]: entry.split(":")[1] for entry in best.split(",")}
    table = allocation_table(out)
    assert set(table) == set(chosen)  # every MFC got the searched layout and mesh
    for name, (ranks, layout) in table.items():
        assert chosen[name] == f"{layout}@{ranks}"
    cache = tmp_path / "cache" / "plan"
    assert len(list(cache.glob("cpu-1t-*.json"))) == 1  # the measured CPU profile
    assert len(list(cache.glob("search-*.json"))) == 1
    again = dry_run(tmp_path, "n_devices_per_node=2")  # the same problem: from the cache
    assert again.returncode == 0, again.stderr
    assert "plan search: cached result" in again.stderr
    assert allocation_table(again.stdout) == table


def test_a_slurm_dry_run_on_gpu_nodes_searches_with_the_analytic_h100(tmp_path):
    without_slurm = {"PATH": os.path.dirname(sys.executable)}  # no sbatch, no nvidia-smi
    result = dry_run(tmp_path, "mode=slurm", "n_nodes=2", "n_devices_per_node=8",
                     "plan.time_budget_s=1", env=without_slurm)
    assert result.returncode == 0, result.stderr
    assert "device: h100, 2 node(s) x 8" in result.stdout
    assert "#SBATCH --nodes=2" in result.stdout
    assert len(allocation_table(result.stdout)) == 6


def test_search_with_a_pipelined_rollout_is_refused_with_the_fix(tmp_path):
    result = dry_run(tmp_path, "n_devices_per_node=2", "pipeline_rollout=true")
    assert result.returncode == 2
    assert "`allocation_mode=search` predicts synchronous steps" in result.stderr
    assert "allocation_mode=auto" in result.stderr and "Traceback" not in result.stderr


def test_launching_with_search_imports_neither_torch_nor_transformers(tmp_path):
    # as tests/launcher/test_launcher_startup.py, with the search (the CPU profile runs in a
    # subprocess of its own)
    script = textwrap.dedent(f"""
        import sys
        import realrl.api.config as config
        import realrl.launcher.processes as processes

        class Started(Exception):
            pass

        def start(self):
            raise Started

        config.may_have_gpus = lambda: False
        processes.ProcessSupervisor.start = start
        from realrl.apps import quickstart

        try:
            quickstart.main(["ppo-math", "output_root={tmp_path}", "wandb.mode=disabled",
                             "n_devices_per_node=2", "allocation_mode=search"])
        except Started:
            pass
        print("imported:", sorted(m for m in ("torch", "transformers") if m in sys.modules))
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "REALRL_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "imported: []" in result.stdout, result.stdout + result.stderr
    chosen = re.search(r"allocation_mode=search: (\S+)", result.stderr).group(1)
    # the workers' plan.json holds the searched allocation
    allocations = json.loads((tmp_path / "ppo-math" / "trial0" / "plan.json").read_text())[
        "allocations"]
    for entry in chosen.split(","):
        name, layout = entry.split(":")
        strategy = allocations[name]["strategy"]
        ranks = allocations[name]["mesh"]["ranks"]
        assert layout.startswith(f"d{strategy['data']}t{strategy['tensor']}p1@{ranks[0]}")
