"""`rollout.mode=async` through the real CLI: generation on worker 0 streams groups while
worker 1 trains, within the staleness bound; eta=0 is synchronous training bit for bit; a
checkpoint records the first untrained batch, so a resumed run loses and repeats no prompt."""

from __future__ import annotations

import json
import shutil

import pytest
from e2e_helpers import (
    checkpoint_weights,
    describe,
    differing_tensors,
    read_metrics,
    run_cli,
    start_cli,
    without_timing,
)

from realrl.datasets.loader import EpochIterator

BATCH_SIZE = 4
# One generating worker, one training worker (what allocation_mode=auto gives async runs).
TWO_WORKERS = [
    "n_devices_per_node=2", f"dataset.batch_size={BATCH_SIZE}", "group_size=2",
    "gen.max_new_tokens=8", "ppo.disable_value=true", "ppo.adv_estimator=grpo",
]
# Every response of every step in samples.jsonl.
EVERY_SAMPLE = [f"log.samples_per_step={2 * BATCH_SIZE}", "log.samples_every_steps=1"]


def _samples(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_async_rollout_with_eta_0_trains_exactly_like_synchronous_training(
    tiny_model, cli_env, tmp_path
):
    """With the whole batch in one request and eta=0, each request starts only once the
    previous step has trained and sent its weights: the same calls as a synchronous step, on
    the same workers. Both runs go side by side (4 workers on the test machine's cores)."""
    common = [
        f"actor.path={tiny_model}", *TWO_WORKERS, "share_idle_cores=false", "seed=3",
        "allocation_mode=actor_train:d1@1,*:d1@0", "total_train_steps=3",
        "wandb.mode=disabled", "tensorboard=false",
    ]
    runs = {
        "sync": [],
        "async": ["rollout.mode=async", "rollout.max_head_offpolicyness=0",
                  f"rollout.groups_per_request={BATCH_SIZE}"],
    }
    processes = {name: start_cli("ppo-math", [*common, f"output_root={tmp_path / name}", *extra],
                                 cli_env, tmp_path / f"{name}-output")
                 for name, extra in runs.items()}
    for name, process in processes.items():
        assert process.wait(timeout=300) == 0, (
            (tmp_path / f"{name}-output" / "stderr.txt").read_text()[-4000:])
    run_dirs = {name: tmp_path / name / "ppo-math" / "trial0" for name in runs}
    sync, streamed = (read_metrics(run_dirs[name]) for name in runs)
    assert [record["async/staleness_max"] for record in streamed] == [0, 0, 0]
    for expected, actual in zip(sync, streamed, strict=True):
        # The synchronous step reused actor_train's forward run ahead; the async one cannot
        # (its rollout ran in another request) and runs it in the train call: same numbers.
        # Its generation ran in chunks (none of which new weights reached: eta=0), which gave
        # the same tokens.
        assert actual["actor_gen/weight_updates"] == 0
        actual = {key: value for key, value in without_timing(actual).items()
                  if not key.startswith("async/")
                  and key not in ("actor_train/forward_reused", "actor_gen/weight_updates")}
        expected = {key: value for key, value in without_timing(expected).items()
                    if key != "actor_train/forward_reused"}
        assert actual == expected
    assert not differing_tensors(checkpoint_weights(run_dirs["sync"], 3, "actor"),
                                 checkpoint_weights(run_dirs["async"], 3, "actor"))


def test_async_rollout_streams_groups_within_the_bound_and_checkpoints_the_untrained_position(
    tiny_model, cli_env, tmp_path
):
    """One group per request, eta=2: every group trains 0 to 2 steps after the weights that
    generated it (its `weight_version`), and each checkpoint's data position is exactly the
    trained batches, whatever was generated ahead."""
    eta = 2
    result = run_cli("ppo-math", [
        f"actor.path={tiny_model}", f"output_root={tmp_path}", *TWO_WORKERS, *EVERY_SAMPLE,
        "rollout.mode=async", f"rollout.max_head_offpolicyness={eta}",
        "rollout.groups_per_request=1",
        "total_train_steps=4", "save_freq_steps=2",
    ], cli_env)
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "ppo-math" / "trial0"
    metrics = read_metrics(run_dir)
    for record in metrics:
        histogram = [record[f"async/staleness_{s}_groups"] for s in range(eta + 1)]
        assert sum(histogram) == BATCH_SIZE and 0 <= record["async/staleness_max"] <= eta
        assert record["actor_train/policy_lag"] == record["async/staleness_max"]
        # a request's generation time counts when it finishes: a step during which the bound
        # held every request back has none (a CI run had one)
        assert 0 <= record["async/generator_busy_fraction"] <= 1
        assert 0 <= record["async/bound_wait_fraction"] <= 1
        assert 0 < record["async/trainer_busy_fraction"] <= 1
        assert record["async/buffer_groups"] >= 0
    assert any(record["async/generator_busy_fraction"] > 0 for record in metrics)
    assert metrics[0]["async/staleness_max"] == 0  # nothing trained before step 1
    for row in _samples(run_dir):
        assert row["step"] - 1 - eta <= row["weight_version"] <= row["step"] - 1
    for step in (2, 4):
        master = json.loads((run_dir / "checkpoints" / f"step{step:06d}" / "master.json")
                            .read_text())
        assert master["data"]["position"] == step * BATCH_SIZE


@pytest.mark.parametrize("kv_cache,interpolate", [
    ("recompute", True), pytest.param("keep", False, marks=pytest.mark.slow)])
def test_new_weights_reach_generations_in_flight_and_no_token_is_lost(
    tiny_model, cli_env, tmp_path, kv_cache, interpolate
):
    """Interruptible generation: one decode step per chunk and eta=3, so the generation worker
    keeps 3 batches ahead while the trainer publishes new weights between its chunks. Every
    response's tokens record their weights' versions: never decreasing along the response
    (a generation only moves to newer weights), the group's `weight_version` its oldest, all
    within the bound; some generations switch versions mid-response, and every step still
    trains `dataset.batch_size` distinct prompts, each response whole. With the decoupled
    loss's interpolated proximal log-probs, each token's own lag sets them: lags 0 and 1 give
    the behaviour log-probs themselves, so a step whose tokens are at most 1 step stale has no
    behaviour mismatch."""
    # A switch needs the trainer to publish while a response is in flight, which is up to the
    # two processes' timing: on a loaded machine a step can go by without one (a 4-step run of
    # a CI had none at all). 8 steps: measured with 4 CPU hogs on 2 cores, 5 to 7 steps of the
    # 7 with a trained version had switches.
    eta, steps = 3, 8
    decoupled = ["ppo.decoupled_loss=true", "ppo.prox_logp=interpolate"] if interpolate else []
    result = run_cli("ppo-math", [
        f"actor.path={tiny_model}", f"output_root={tmp_path}", *TWO_WORKERS, *EVERY_SAMPLE,
        "rollout.mode=async", f"rollout.max_head_offpolicyness={eta}",
        "rollout.groups_per_request=1", "rollout.decode_steps_per_chunk=1",
        f"rollout.interrupt_kv_cache={kv_cache}", f"total_train_steps={steps}", *decoupled,
    ], cli_env)
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "ppo-math" / "trial0"
    rows = _samples(run_dir)
    assert len(rows) == steps * 2 * BATCH_SIZE
    switched = 0
    for row in rows:
        versions = row["token_weight_versions"]
        assert 1 <= len(versions) <= 8 and versions == sorted(versions)
        assert row["step"] - 1 - eta <= versions[0] and versions[-1] <= row["step"] - 1
        assert row["weight_version"] <= versions[0]  # the oldest of its group's responses
        switched += versions[0] != versions[-1]
    metrics = read_metrics(run_dir)
    # The generator runs ahead of the trainer from the start, so weights reach it mid-response.
    assert switched > 0 and sum(record["async/interrupted_groups"] for record in metrics) > 0
    for record in metrics:
        assert record["async/token_staleness_max"] <= record["async/staleness_max"] <= eta
        if interpolate:
            mismatch = record["actor_train/behav_logp_abs_diff"]
            assert mismatch == 0 if record["async/token_staleness_max"] <= 1 else mismatch > 0
    assert len({row["query_id"] for row in rows}) == steps * BATCH_SIZE


def test_finished_first_assembly_with_best_of_n_trains_full_batches_within_the_bound(
    tiny_model, cli_env, tmp_path
):
    """The rollout filter on each request as it finishes (best-of-n: 4 responses generated per
    prompt, the best 2 kept, the rest counted as thrown away), and steps that train the first
    groups to finish: full batches of distinct prompts, none staler than eta."""
    eta, steps = 2, 3
    result = run_cli("ppo-math", [
        f"actor.path={tiny_model}", f"output_root={tmp_path}", *TWO_WORKERS, *EVERY_SAMPLE,
        "generation_size=4", "rollout.mode=async", "rollout.assembly=finished_first",
        f"rollout.max_head_offpolicyness={eta}", "rollout.groups_per_request=1",
        f"total_train_steps={steps}", "save_freq_steps=2",
    ], cli_env)
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "ppo-math" / "trial0"
    # The trained groups are no prefix of the data: a checkpoint records the position past
    # every batch drawn (whole batches), so a resumed run trains no prompt twice.
    master = json.loads((run_dir / "checkpoints" / "step000002" / "master.json").read_text())
    position = master["data"]["position"]
    assert 2 * BATCH_SIZE <= position <= (2 + eta + 1) * BATCH_SIZE
    assert position % BATCH_SIZE == 0
    metrics = read_metrics(run_dir)
    for record in metrics:
        assert record["actor_train/num_sequences"] == 2 * BATCH_SIZE
        assert 0 <= record["async/staleness_max"] <= eta
        assert record["async/discarded_groups"] == 0  # best-of-n drops responses, not prompts
    # Every prompt's 2 responses not kept are thrown away: at least one token each.
    assert sum(record["async/discarded_tokens"] for record in metrics) >= 2 * BATCH_SIZE * steps
    rows = _samples(run_dir)
    assert len({row["query_id"] for row in rows}) == steps * BATCH_SIZE


def test_async_dynamic_sampling_stops_with_a_clear_error_when_every_group_agrees(
    tiny_model, cli_env, tmp_path
):
    data = tmp_path / "impossible.jsonl"  # no model answers "banana": every reward is 0
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": "banana"}) + "\n"
                            for i in range(40)))
    result = run_cli("ppo-math", [
        f"actor.path={tiny_model}", f"output_root={tmp_path}", *TWO_WORKERS,
        f"dataset.path={data}", "ppo.dynamic_sampling=true", "ppo.max_generation_rounds=2",
        "rollout.mode=async", "rollout.assembly=finished_first", "total_train_steps=2",
    ], cli_env)
    assert result.returncode != 0
    assert "too easy or too hard" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.slow
def test_an_async_run_resumed_mid_run_trains_the_same_prompts_once(tiny_model, cli_env, tmp_path):
    """A 4-step run checkpoints after step 2, while groups of steps 3-4 are generated ahead;
    resumed from that checkpoint (the step-4 one removed, as if the run had died before it),
    steps 3 and 4 train the same prompts as the uninterrupted run, and the 16 prompts of steps
    1-4 are 16 different ones: none lost, none trained twice."""
    overrides = [
        f"actor.path={tiny_model}", f"output_root={tmp_path}", *TWO_WORKERS, *EVERY_SAMPLE,
        "rollout.mode=async", "rollout.max_head_offpolicyness=2", "total_train_steps=4",
        "save_freq_steps=2",
    ]
    first = run_cli("ppo-math", overrides, cli_env)
    assert first.returncode == 0, describe(first)
    run_dir = tmp_path / "ppo-math" / "trial0"
    uninterrupted = _prompts_per_step(run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step000004")
    resumed = run_cli("ppo-math", [*overrides, "recover_mode=auto"], cli_env)
    assert resumed.returncode == 0, describe(resumed)
    assert [record["step"] for record in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert _prompts_per_step(run_dir) == uninterrupted
    assert all(len(prompts) == BATCH_SIZE for prompts in uninterrupted.values())
    assert len(set().union(*uninterrupted.values())) == 4 * BATCH_SIZE


def _prompts_per_step(run_dir) -> dict[int, set[str]]:
    prompts: dict[int, set[str]] = {}
    for row in _samples(run_dir):
        prompts.setdefault(row["step"], set()).add(row["query_id"])
    return prompts


@pytest.mark.parametrize("trainer", [
    "d2", pytest.param("d1t2", marks=pytest.mark.slow)])
def test_async_rollout_on_disjoint_data_parallel_meshes_of_two_workers_each(
    tiny_model, cli_env, tmp_path, trainer
):
    """4 workers: generation (with the reward and reference MFCs) data-parallel on workers 0-1,
    training on workers 2-3 (data- or tensor-parallel), interruptible generation. Each request
    of 2 groups is split over the 2 generation ranks, which take new weights between their
    decode steps; the 2-worker runs' invariants hold: every step trains
    `dataset.batch_size` distinct prompts, each group within the bound, every response's
    token versions never decreasing and within it."""
    eta, steps = 2, 3
    result = run_cli("ppo-math", [
        f"actor.path={tiny_model}", f"output_root={tmp_path}", *EVERY_SAMPLE,
        *[override for override in TWO_WORKERS if not override.startswith("n_devices")],
        "n_devices_per_node=4", "allow_oversubscribe=true",
        f"allocation_mode=actor_gen:d2@0-1,actor_train:{trainer}@2-3,*:d2@0-1",
        "rollout.mode=async", f"rollout.max_head_offpolicyness={eta}",
        "rollout.groups_per_request=2", "rollout.decode_steps_per_chunk=1",
        f"total_train_steps={steps}",
    ], cli_env)
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "ppo-math" / "trial0"
    allocations = json.loads((run_dir / "plan.json").read_text())["allocations"]
    assert allocations["actor_gen"]["mesh"]["ranks"] == [0, 1]
    assert allocations["actor_train"]["mesh"]["ranks"] == [2, 3]
    metrics = read_metrics(run_dir)
    assert [record["step"] for record in metrics] == list(range(1, steps + 1))
    for record in metrics:
        assert record["actor_train/num_sequences"] == 2 * BATCH_SIZE
        assert record["async/token_staleness_max"] <= record["async/staleness_max"] <= eta
        assert sum(record[f"async/staleness_{s}_groups"] for s in range(eta + 1)) == BATCH_SIZE
    rows = _samples(run_dir)
    assert len(rows) == steps * 2 * BATCH_SIZE
    for row in rows:
        versions = row["token_weight_versions"]
        assert 1 <= len(versions) <= 8 and versions == sorted(versions)
        assert row["step"] - 1 - eta <= versions[0] and versions[-1] <= row["step"] - 1
        assert row["weight_version"] <= versions[0]
    assert len({row["query_id"] for row in rows}) == steps * BATCH_SIZE


@pytest.mark.slow
def test_a_finished_first_run_resumed_mid_run_trains_every_prompt_once(
    tiny_model, cli_env, tmp_path
):
    """`rollout.assembly=finished_first` trains no prefix of the data: a 4-step run checkpoints
    after step 2 with groups generated ahead and not trained; the checkpoint owes them by query
    id, and the run resumed from it (the step-4 checkpoint removed) trains them first. Over the
    interrupted and the resumed run, the data stream up to the last checkpoint's position is
    exactly the trained prompts, each trained once, and the prompts that checkpoint still owes."""
    seed, records = 5, 64
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"query_id": f"q{i}", "prompt": f"{i % 9}+{i % 7}=",
                                        "answer": str(i % 9 + i % 7)}) + "\n"
                            for i in range(records)))
    overrides = [
        f"actor.path={tiny_model}", f"output_root={tmp_path}", *TWO_WORKERS, *EVERY_SAMPLE,
        f"dataset.path={data}", f"seed={seed}", "rollout.mode=async",
        "rollout.assembly=finished_first", "rollout.max_head_offpolicyness=2",
        "rollout.groups_per_request=1", "total_train_steps=4", "save_freq_steps=2",
    ]
    first = run_cli("ppo-math", overrides, cli_env)
    assert first.returncode == 0, describe(first)
    run_dir = tmp_path / "ppo-math" / "trial0"
    shutil.rmtree(run_dir / "checkpoints" / "step000004")
    resumed = run_cli("ppo-math", [*overrides, "recover_mode=auto"], cli_env)
    assert resumed.returncode == 0, describe(resumed)
    assert [record["step"] for record in read_metrics(run_dir)] == [1, 2, 3, 4]
    trained = _prompts_per_step(run_dir)
    assert all(len(prompts) == BATCH_SIZE for prompts in trained.values())
    every_trained = [query_id for prompts in trained.values() for query_id in prompts]
    assert len(set(every_trained)) == 4 * BATCH_SIZE  # none trained twice
    responses = [row["query_id"] for row in _samples(run_dir)]
    assert all(responses.count(query_id) == 2 for query_id in every_trained)  # group_size
    last = json.loads((run_dir / "checkpoints" / "step000004" / "master.json").read_text())
    owed = last["data"].get("pending_query_ids", [])
    assert not set(owed) & set(every_trained)
    order = EpochIterator(records, BATCH_SIZE, seed).next_batch  # the run's data stream
    assert last["data"]["epoch"] == 0
    stream = [f"q{index}" for _ in range(last["data"]["position"] // BATCH_SIZE)
              for index in order()]
    assert sorted(stream) == sorted(every_trained + owed)  # none lost
