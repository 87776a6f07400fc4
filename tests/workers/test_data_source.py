"""The master's data source: the prompts a finished-first checkpoint owes (drawn and not
trained) are served first, in full batches topped up from the iterator, and recorded by query
id in the state a checkpoint saves; a state without them (an older checkpoint) owes nothing."""

from __future__ import annotations

import json

import pytest

import realrl.experiments  # noqa: F401  (registers ppo-math)
from realrl.api import config as api_config
from realrl.api.config import resolve_config
from realrl.api.registry import get_experiment
from realrl.datasets.loader import EpochIterator
from realrl.launcher.defaults import fresh_default_model
from realrl.launcher.plan import build_plan
from realrl.launcher.prepare import write_run_files
from realrl.models.tokenizer import load_tokenizer
from realrl.workers.data_source import DataSource

RECORDS, BATCH_SIZE, SEED = 12, 4, 3


@pytest.fixture
def make_source(tmp_path, monkeypatch):
    monkeypatch.setattr(api_config, "may_have_gpus", lambda: False)
    model = fresh_default_model(tmp_path / "model")
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"query_id": f"q{i}", "prompt": f"{i}+1=",
                                        "answer": str(i + 1)}) + "\n" for i in range(RECORDS)))
    config = resolve_config(get_experiment("ppo-math").config_class, [
        f"output_root={tmp_path / 'runs'}", f"actor.path={model}", f"dataset.path={data}",
        f"dataset.batch_size={BATCH_SIZE}", f"seed={SEED}", "n_devices_per_node=1"])
    launch_plan = build_plan(config)
    launch_plan.run_dir.mkdir(parents=True)
    plan = write_run_files(config, launch_plan)
    return lambda: DataSource(plan, load_tokenizer(str(model)))


def _stream(batches: int) -> list[str]:
    order = EpochIterator(RECORDS, BATCH_SIZE, SEED)
    return [f"q{index}" for _ in range(batches) for index in order.next_batch()]


def test_owed_prompts_come_first_in_full_batches_and_survive_a_save(make_source):
    source = make_source()
    stream = _stream(3)
    assert source.next_batch().ids == stream[:4]
    assert "pending_query_ids" not in source.state_dict()  # nothing owed: as before
    source.owe([stream[1], stream[3]])  # drawn, not trained
    state = source.state_dict()
    assert state["pending_query_ids"] == [stream[1], stream[3]]
    assert state["position"] == BATCH_SIZE
    resumed = make_source()
    resumed.load_state_dict(state)
    # The 2 owed prompts, topped up to a full batch from the recorded position; the rest of
    # that drawn batch stays owed (and in the state) until served.
    assert resumed.next_batch().ids == [stream[1], stream[3], *stream[4:6]]
    assert resumed.state_dict()["pending_query_ids"] == stream[6:8]
    assert resumed.next_batch().ids == stream[6:8] + stream[8:10]
    assert resumed.next_batch().ids == stream[10:12] + _stream(4)[12:14]


def test_an_older_state_owes_nothing_and_an_unknown_owed_id_names_the_fix(make_source):
    source = make_source()
    source.next_batch()
    state = source.state_dict()
    resumed = make_source()
    resumed.load_state_dict(state)
    assert resumed.next_batch().ids == _stream(2)[4:]
    with pytest.raises(ValueError, match="pending_query_ids names \\['x1'\\].*dataset"):
        resumed.load_state_dict({**state, "pending_query_ids": ["x1"]})
