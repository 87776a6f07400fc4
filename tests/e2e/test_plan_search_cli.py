"""`allocation_mode=search` in a real local run: the searched plan is the one the workers run."""

from __future__ import annotations

import json
import re

import pytest
from e2e_helpers import run_cli


@pytest.mark.slow
def test_a_ppo_run_with_a_searched_allocation_trains_on_it(cli_env, tmp_path):
    result = run_cli("ppo-math", [
        f"output_root={tmp_path}", "n_devices_per_node=2", "allocation_mode=search",
        "total_train_steps=2", "dataset.batch_size=4", "group_size=2", "gen.max_new_tokens=4",
    ], cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
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
