"""The master's metrics logger: the progress line and its ETA, samples.jsonl, tensorboard."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest

from realrl.api.config import BaseExperimentConfig, LogConfig, WandbConfig, WandbMode
from realrl.workers import metrics_log
from realrl.workers.metrics_log import MetricsLogger, parse_progress_line, progress_line


def settings(total_train_steps: int, tensorboard: bool = False) -> BaseExperimentConfig:
    return BaseExperimentConfig(total_train_steps=total_train_steps, tensorboard=tensorboard,
                                wandb=WandbConfig(mode=WandbMode.disabled))


def test_eta_after_a_resume_leaves_out_the_first_steps_start_up_cost(tmp_path, monkeypatch,
                                                                      capsys):
    # Resumed at step 96 of 100: the first step compiles (90 s), every later one takes 6 s.
    # Averaging the first step in showed 270 s after step 97 (90 s * 3 left) and 96 s after
    # step 98 (96 s / 2 * 2 left), for 18 s and 12 s left.
    now = [0.0]
    monkeypatch.setattr(metrics_log, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    logger = MetricsLogger(tmp_path, settings(100), first_step=96)
    etas = []
    for step, seconds in ((97, 90.0), (98, 6.0), (99, 6.0), (100, 6.0)):
        now[0] += seconds
        logger.log(step, {"timing/step_s": seconds})
        etas.append(re.search(r"\| eta +(\S+) \|", capsys.readouterr().out).group(1))
    assert etas == ["?", "12s", "6s", "0s"]  # 6 s a step times the steps left


def test_progress_line_leads_with_step_eta_and_reward_and_is_recognised():
    metrics = {"reward/task_mean": 0.25, "batch/rm_scores/mean": 0.5, "actor_train/kl_to_ref": 0.01,
               "timing/step_s": 1.5, "timing/actor_gen": 0.75, "timing/realloc/actor_gen": 0.1}
    line = progress_line(4, 20, 372.0, metrics, ["rm_scores"])
    assert line == ("step 4/20 | eta 6m12s | reward 0.25 | rm_scores 0.5 | kl 0.01 | 1.50s/step"
                    " | actor_gen 0.75")
    assert parse_progress_line(line) == (4, 20)
    assert parse_progress_line("12:00:01 INFO realrl.workers.master_main: step 4/20") is None


def test_samples_are_appended_per_step_and_a_resume_drops_the_redone_steps(tmp_path):
    logger = MetricsLogger(tmp_path, settings(3), first_step=0)
    row = {"query_id": "q0", "prompt": "1+1=", "response": "2", "reward": 1.0}
    logger.log_samples(1, [row])
    logger.log_samples(2, [row, row | {"query_id": "q1"}])
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines][1] == {"step": 2, **row}
    assert len(lines) == 3

    MetricsLogger(tmp_path, settings(3), first_step=1)  # resumed from the step-1 checkpoint
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]


def test_missing_tensorboard_is_said_once_with_the_fix(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with caplog.at_level("WARNING", logger=metrics_log.__name__):
        logger = MetricsLogger(tmp_path, settings(2, tensorboard=True), first_step=0)
        logger.log(1, {"timing/step_s": 1.0})
        logger.log(2, {"timing/step_s": 1.0})
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "pip install tensorboard" in warnings[0], warnings
    assert "tensorboard=false" in warnings[0]
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_gets_scalars_and_sample_text(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, settings(2, tensorboard=True), first_step=0)
    logger.log(1, {"reward/task_mean": 0.5, "timing/step_s": 2.0})
    logger.log_samples(1, [{"query_id": "q0", "prompt": "1+1=", "response": "2", "reward": 1.0}])
    logger.log(2, {"reward/task_mean": 0.75, "timing/step_s": 1.5})
    logger.finish()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(event.step, event.value) for event in events.Scalars("reward/task_mean")] == [
        (1, 0.5), (2, 0.75)]
    assert [(event.step, event.value) for event in events.Scalars("timing/step_s")] == [
        (1, 2.0), (2, 1.5)]
    # One event a step carries all its scalars (an event per metric cost the master 5x).
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    (events_file,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    scalar_events = [(event.step, sorted(value.tag for value in event.summary.value))
                     for event in LegacyEventFileLoader(str(events_file)).Load()
                     if any(value.HasField("simple_value") for value in event.summary.value)]
    assert scalar_events == [(1, ["reward/task_mean", "timing/step_s"]),
                             (2, ["reward/task_mean", "timing/step_s"])]
    (text,) = events.Tensors("samples/text_summary")
    assert "1+1=" in text.tensor_proto.string_val[0].decode()


def test_log_settings_are_checked_with_the_key_and_the_fix():
    config = BaseExperimentConfig(log=LogConfig(samples_per_step=-1,
                                                per_sample_keys=["rm_scores", "rm_scores"]))
    assert config.validate() == [
        "`log.samples_per_step=-1` must be >= 0 (0: off).",
        "`log.per_sample_keys` names ['rm_scores'] more than once.",
    ]


def test_wandb_gets_the_samples_as_a_table(tmp_path):
    base = BaseExperimentConfig(experiment_name="table", total_train_steps=1, tensorboard=False,
                                wandb=WandbConfig(mode=WandbMode.offline))
    logger = MetricsLogger(tmp_path, base, first_step=0)
    logger.log(1, {"reward/task_mean": 1.0})
    logger.log_samples(1, [{"query_id": "q0", "prompt": "1+1=", "response": "2", "reward": 1.0}])
    logger.finish()
    (table,) = tmp_path.glob("wandb/offline-run-*/files/media/table/samples_1_*.table.json")
    assert json.loads(table.read_text()) == {
        "columns": ["query_id", "prompt", "response", "reward"], "data": [["q0", "1+1=", "2", 1.0]]}
