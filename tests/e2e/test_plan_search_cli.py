"""`allocation_mode=search` in a real local run, calibrated by `realrl.apps.profile_plan`: the
searched plan is the one the workers run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import run_cli

KEYS = ["n_devices_per_node=2", "dataset.batch_size=4", "group_size=2", "gen.max_new_tokens=4",
        "ppo.disable_value=true", "ppo.adv_estimator=grpo"]


@pytest.mark.slow
def test_profile_plan_calibrates_the_search_and_a_run_trains_on_the_searched_plan(cli_env,
                                                                                 tmp_path):
    uncalibrated = run_cli("ppo-math", [*KEYS, "allocation_mode=search", "--dry-run"], cli_env)
    assert uncalibrated.returncode == 0, uncalibrated.stderr[-3000:]
    assert "per-MFC costs not calibrated" in uncalibrated.stdout
    profiled = subprocess.run(
        [sys.executable, "-m", "realrl.apps.profile_plan", "ppo-math", *KEYS, "--steps", "2",
         "--work-dir", str(tmp_path / "probes")],
        env=cli_env, capture_output=True, text=True, timeout=600)
    assert profiled.returncode == 0, profiled.stderr[-3000:]
    # the three probes ran (one worker, both data-parallel, tensor-parallel) and were fitted,
    # and the side-by-side one (the reference's inference beside the actor's forward sent
    # ahead) gave the contention between the two workers
    side_by_side = ("actor_gen:d1t1p1@0,ref_inf:d1t1p1@1,rew_inf:d1t1p1@0,"
                    "actor_train:d1t1p1@0")
    for probe in ("*:d1@0", "d2", "d1t2", side_by_side):
        assert f"| `{probe}` | step |" in profiled.stdout
    assert f"| `{side_by_side}` | actor_train/forward | d1t1p1 |" in profiled.stdout
    assert re.search(r"^contention [0-9.]+: with k of a machine's workers busy", profiled.stdout,
                     re.MULTILINE), profiled.stdout
    for mfc in ("actor_gen", "rew_inf", "actor_train"):
        assert re.search(rf"^  {mfc} +scale [0-9.]+, offset -?[0-9.]+ s, t2 ", profiled.stdout,
                         re.MULTILINE), profiled.stdout
    (calibration,) = (Path(cli_env["REALRL_CACHE"]) / "plan").glob("calibration-*.json")

    result = run_cli("ppo-math", [*KEYS, f"output_root={tmp_path}", "allocation_mode=search",
                                  "total_train_steps=2"], cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"plan search: per-MFC costs calibrated by real runs ({calibration})" in result.stderr
    chosen = re.search(r"allocation_mode=search: (\S+) \(predicted", result.stderr).group(1)
    run_dir = tmp_path / "ppo-math" / "trial0"
    allocations = json.loads((run_dir / "plan.json").read_text())["allocations"]
    for entry in chosen.split(","):
        name, layout = entry.split(":")
        strategy = allocations[name]["strategy"]
        ranks = allocations[name]["mesh"]["ranks"]
        assert layout == (f"d{strategy['data']}t{strategy['tensor']}p{strategy['pipeline']}@"
                          + (f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"{ranks[0]}"))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [1, 2]
