"""`read_metrics`, which every end-to-end test reads a run's metrics with, fails on a key that
`docs/metrics.md` does not name: the reference cannot fall behind what runs log."""

from __future__ import annotations

import json

import pytest
from e2e_helpers import documented_metrics, read_metrics


def write_metrics(run_dir, *records):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_documented_keys_and_placeholders_pass(tmp_path):
    write_metrics(tmp_path, {"step": 1, "reward/task_mean": 0.5, "timing/actor_gen": 0.1,
                             "critic_train/peak_memory_gb": 1.0, "async/staleness_3_groups": 2,
                             "rew_inf/math_accuracy": 0.5, "batch/gold_scores/std": 0.1})
    assert read_metrics(tmp_path)[0]["step"] == 1


def test_an_undocumented_key_fails_with_its_name(tmp_path):
    write_metrics(tmp_path, {"step": 1, "actor_train/loss": 0.1},
                  {"step": 2, "actor_train/made_up_stat": 0.0})
    with pytest.raises(AssertionError, match=r"does not name: \['actor_train/made_up_stat'\]"):
        read_metrics(tmp_path)
    # a placeholder stands for one name, not a path
    write_metrics(tmp_path, {"step": 1, "timing/actor_gen/extra/deep": 0.1})
    with pytest.raises(AssertionError, match="timing/actor_gen/extra/deep"):
        read_metrics(tmp_path)


def test_a_test_experiments_own_mfcs_may_log_anything(tmp_path):
    write_metrics(tmp_path, {"step": 1, "gold_inf/score_mean": 0.2})
    assert read_metrics(tmp_path, custom_mfcs=("gold_inf",))
    with pytest.raises(AssertionError, match="gold_inf/score_mean"):
        read_metrics(tmp_path)


def test_the_reference_names_the_built_in_statistics():
    names = {pattern.pattern for pattern in documented_metrics()}
    assert len(names) > 100  # the tables were parsed, placeholders and all
    assert r"actor_train/early_stopped_microbatches" in names
    assert r"[^/]+/peak_memory_gb" in names
