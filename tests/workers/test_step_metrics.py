"""The master's per-step timing metrics, synchronous and pipelined, on hand-made step results."""

from __future__ import annotations

import pytest

from realrl.api.data import SequenceSample
from realrl.workers.master import StepResult
from realrl.workers.master_main import saves_after, step_metrics
from realrl.workers.run_plan import base_settings


def _result() -> StepResult:
    result = StepResult(data=SequenceSample.from_default(ids=[], seqlens=[], data={}))
    result.compute = {"actor_gen": 0.30, "rew_inf": 0.02, "actor_train": 0.40}
    result.timing = {"actor_gen": 0.31, "actor_train": 0.41, "realloc/actor_gen": 0.02}
    return result


def test_synchronous_step_counts_the_compute_of_every_mfc():
    metrics = step_metrics(_result(), step_seconds=0.80)
    assert metrics["perf/compute_s"] == pytest.approx(0.72)
    assert metrics["perf/overhead_fraction"] == pytest.approx(0.1)  # 1 - 0.72 / 0.80
    assert "timing/rollout_wait_s" not in metrics


def test_pipelined_step_counts_its_wait_for_the_rollout_and_its_training():
    # The rollout's 0.32 s of compute ran during the previous step; this one waited 0.05 s.
    metrics = step_metrics(_result(), step_seconds=0.50, rollout_wait_s=0.05,
                           train_mfcs=["actor_train"])
    assert metrics["perf/compute_s"] == pytest.approx(0.45)
    assert metrics["perf/overhead_fraction"] == pytest.approx(0.1)  # 1 - 0.45 / 0.50
    assert metrics["timing/rollout_wait_s"] == 0.05


def test_checkpoints_follow_the_save_frequency_and_the_last_step():
    from realrl.api.config import BaseExperimentConfig

    base = base_settings(BaseExperimentConfig(total_train_steps=7, save_freq_steps=3))
    assert [n for n in range(1, 8) if saves_after(base, n)] == [3, 6, 7]
    assert [n for n in range(1, 8) if saves_after(base_settings(
        BaseExperimentConfig(total_train_steps=7)), n)] == [7]
