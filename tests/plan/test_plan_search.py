"""The search finds known optima on small synthetic problems and never returns a plan over
the memory limit (model and device: `plan_fixtures`)."""

from __future__ import annotations

import dataclasses

import pytest
from plan_fixtures import cluster, layout, work

from realrl.plan.calibration import Calibration, MFCCorrection
from realrl.plan.costs import WorkKind
from realrl.plan.memory import peak_bytes_per_device
from realrl.plan.report import describe, timeline_table
from realrl.plan.search import Evaluator, SearchProblem, search


def two_trainers(memory_bytes: float = 1e12) -> SearchProblem:
    """Two independent train calls of different roles on 2 devices of one node."""
    works = {"actor_train": work(WorkKind.train_step, name="actor_train", role="actor"),
             "critic_train": work(WorkKind.train_step, name="critic_train", role="critic")}
    return SearchProblem(works, {}, cluster(n_devices_per_node=2, memory_bytes=memory_bytes))


def test_independent_trainers_go_side_by_side_when_gradient_sums_are_slow():
    # Each alone on one device: 94.312 s, both at once. Both d2 on both devices: 47.656 s of
    # compute + 55.08 s of gradient sum each, one after the other: 205.5 s.
    result = search(two_trainers())
    assert result.exhaustive
    best = result.plans[0]
    assert best.step_seconds == pytest.approx(94.312)
    actor, critic = best.layouts["actor_train"], best.layouts["critic_train"]
    assert actor.mesh.size == critic.mesh.size == 1 and actor.mesh != critic.mesh
    assert result.symmetric is not None
    assert result.symmetric.step_seconds == pytest.approx(2 * (47.656 + 55.08))


def test_no_returned_plan_exceeds_the_memory_limit():
    # One device: a trainer d1 with 1 micro-batch peaks at 21632 + 19392 = 41024 B, with 2 at
    # 21632 + 9696 = 31328 B (test_plan_memory). Sweep limits around and below those.
    for limit in (1e12, 41024, 41023, 35000, 31328, 30000, 20000):
        problem = two_trainers(memory_bytes=limit)
        try:
            result = search(problem, keep=10)
        except ValueError as error:
            assert "fits" in str(error)
            continue
        for plan in result.plans:
            peaks = peak_bytes_per_device(problem.works, plan.layouts)
            assert max(peaks.values()) <= limit, (limit, plan.allocation_mode())


def test_a_tight_limit_forces_micro_batches_and_an_impossible_one_names_the_mfcs():
    result = search(two_trainers(memory_bytes=35000))
    layouts = result.plans[0].layouts
    assert all(layout.num_microbatches == 2 or layout.strategy.data == 2
               for layout in layouts.values())
    with pytest.raises(ValueError, match="actor_train, critic_train"):
        search(two_trainers(memory_bytes=20000))


def test_annealing_finds_the_exhaustive_optimum_of_a_small_rlhf_graph():
    works = {
        "actor_gen": work(WorkKind.generate, name="actor_gen", num_sequences=4,
                          role_is_trained=True),
        "ref_inf": work(WorkKind.inference, name="ref_inf", role="ref", num_sequences=4),
        "reward": work(WorkKind.rule, name="reward", role="reward", model=None, num_sequences=4),
        "actor_train": work(WorkKind.train_step, name="actor_train", num_sequences=4,
                            role_is_trained=True),
    }
    dependencies = {"ref_inf": ("actor_gen",), "reward": ("actor_gen",),
                    "actor_train": ("ref_inf", "reward")}
    problem = SearchProblem(works, dependencies, cluster(n_nodes=2, n_devices_per_node=2,
                                                         overhead_s=0.3))
    exhaustive = search(problem)
    assert exhaustive.exhaustive
    annealed = search(problem, exhaustive_limit=0, time_budget_s=60, max_evaluations=3000)
    assert not annealed.exhaustive
    assert annealed.plans[0].step_seconds == pytest.approx(exhaustive.plans[0].step_seconds)
    # the best plan beats every symmetric one, and the plans come best first
    assert exhaustive.plans[0].step_seconds < exhaustive.symmetric.step_seconds
    steps = [plan.step_seconds for plan in exhaustive.plans]
    assert steps == sorted(steps) and len(steps) == 5


def test_the_timeline_waits_for_inputs_and_for_the_mesh():
    works = {"actor_gen": work(WorkKind.generate, name="actor_gen", role_is_trained=True),
             "actor_train": work(WorkKind.train_step, name="actor_train",
                                 role_is_trained=True)}
    result = search(SearchProblem(works, {"actor_train": ("actor_gen",)},
                                  cluster(n_devices_per_node=1)))
    generate, train = result.plans[0].timeline
    assert generate.start_s == 0.0 and generate.realloc_s == 0.0  # the same layout: no move
    assert train.start_s == pytest.approx(generate.finish_s)
    # 30.912 s generating (test_plan_costs) + 94.312 s training
    assert result.plans[0].step_seconds == pytest.approx(30.912 + 94.312)


def test_the_report_names_what_the_runner_up_changed_and_what_it_cost():
    problem = two_trainers()
    result = search(problem)
    text = describe(problem, result)
    assert f"#1: {result.plans[0].step_seconds:.3f} s per step" in text
    assert "allocation_mode='actor_train:d1t1p1@" in text
    assert "symmetric layout (d2t1p1 for every MFC on all devices): 205.472 s" in text
    # the runner-up runs both trainers on one device, one after the other: 2 x 94.312 s
    why = text.split("why #2 lost: ", 1)[1]
    assert why.startswith("the runner-up is 94.312 s (100.00%) slower:")
    assert "instead of d1t1p1@" in why and "ends 94.312 -> 188.624 s" in why


def rule_calls(seconds: dict[str, float], dependencies: dict[str, tuple[str, ...]],
               parallel: int | None) -> SearchProblem:
    """Rule-reward calls (no model, no communication) that take exactly `seconds` at full
    speed (a calibration of scale 0 and that offset), on 4 devices of one node of which
    `parallel` run at full speed at once."""
    works = {name: work(WorkKind.rule, name=name, role=name, model=None) for name in seconds}
    corrections = tuple((name, MFCCorrection(0.0, s)) for name, s in seconds.items())
    machine = dataclasses.replace(cluster(), parallel_devices_per_node=parallel)
    return SearchProblem(works, dependencies, machine, calibration=Calibration(corrections))


def test_calls_side_by_side_on_shared_cores_run_at_their_share_of_them():
    # 4 workers on 2 cores. a (1 s, workers 0-1) and b (3 s, workers 2-3) start together: 4
    # busy workers, each at half speed, so a ends at 2 s with b a third done; b then runs alone
    # on 2 workers at full speed and ends at 2 + 2 = 4 s. c needs both and spans the 4
    # workers: half speed, 2 s, so the step ends at 6 s (with a core per worker: 3 + 1 = 4 s).
    seconds = {"a": 1.0, "b": 3.0, "c": 1.0}
    layouts = {"a": layout([0, 1], data=2), "b": layout([2, 3], data=2),
               "c": layout([0, 1, 2, 3], data=4)}
    dependencies = {"c": ("a", "b")}
    shared = Evaluator(rule_calls(seconds, dependencies, parallel=2)).plan(layouts)
    a, b, c = shared.timeline
    assert (a.start_s, a.finish_s) == (0.0, pytest.approx(2.0))
    assert (b.start_s, b.finish_s) == (0.0, pytest.approx(4.0))
    assert (c.start_s, c.finish_s) == (pytest.approx(4.0), pytest.approx(6.0))
    assert shared.step_seconds == pytest.approx(6.0)
    own_cores = Evaluator(rule_calls(seconds, dependencies, parallel=None)).plan(layouts)
    assert own_cores.step_seconds == pytest.approx(4.0)


def test_the_event_simulation_without_sharing_is_the_list_schedule():
    # parallel = the node's 4 devices: every call at full speed, so the event simulation must
    # give the graph-order schedule's starts and ends exactly.
    seconds = {"a": 1.0, "b": 3.0, "c": 0.5, "d": 2.0}
    layouts = {"a": layout([0, 1], data=2), "b": layout([2]), "c": layout([1, 2], data=2),
               "d": layout([0])}
    dependencies = {"c": ("a",), "d": ("a",)}
    simulated = Evaluator(rule_calls(seconds, dependencies, parallel=4)).plan(layouts)
    scheduled = Evaluator(rule_calls(seconds, dependencies, parallel=None)).plan(layouts)
    assert [(e.start_s, e.finish_s) for e in simulated.timeline] == [
        (pytest.approx(e.start_s), pytest.approx(e.finish_s)) for e in scheduled.timeline]
    # c waits for a and for worker 2 (b): starts at 3 s; d for a only: 1 s to 3 s.
    assert [(e.start_s, e.finish_s) for e in scheduled.timeline] == [
        (0.0, 1.0), (0.0, 3.0), (3.0, 3.5), (1.0, 3.0)]


def test_a_train_calls_forward_sent_ahead_runs_beside_the_inference_calls():
    # gen (1 s, worker 0) -> critic (2 s, worker 1), ref (1 s, both) -> train (3 s, worker 0).
    # The train's forward (a third: 1 s) goes out once gen is done, before the calls gen made
    # ready: worker 0 runs it at 1-2 s while worker 1 runs critic at 1-3 s; ref then waits for
    # both workers (3-4 s) and the rest of the train runs 4-6 s. Sent with the call: 7 s.
    seconds = {"gen": 1.0, "critic": 2.0, "ref": 1.0, "train": 3.0}
    layouts = {"gen": layout([0]), "critic": layout([1]), "ref": layout([0, 1], data=2),
               "train": layout([0])}
    dependencies = {"critic": ("gen",), "ref": ("gen",), "train": ("gen", "critic", "ref")}
    problem = rule_calls(seconds, dependencies, parallel=None)
    ahead = dataclasses.replace(problem, works={
        **problem.works,
        "train": dataclasses.replace(problem.works["train"], forward_ahead_after=("gen",))})
    plan = Evaluator(ahead).plan(layouts)
    assert [(e.name, e.part, e.start_s, e.finish_s) for e in plan.timeline] == [
        ("gen", "", 0.0, 1.0), ("train", "forward", 1.0, 2.0), ("critic", "", 1.0, 3.0),
        ("ref", "", 3.0, 4.0), ("train", "", 4.0, pytest.approx(6.0))]
    assert Evaluator(problem).plan(layouts).step_seconds == pytest.approx(7.0)
    # the event simulation gives the same when nothing shares cores
    simulated = Evaluator(dataclasses.replace(
        ahead, cluster=dataclasses.replace(ahead.cluster, parallel_devices_per_node=4)))
    assert [(e.start_s, e.finish_s) for e in simulated.plan(layouts).timeline] == [
        (pytest.approx(e.start_s), pytest.approx(e.finish_s)) for e in plan.timeline]
    table = timeline_table(ahead, plan).splitlines()
    assert table[2].split()[:3] == ["train/forward", "d1t1p1", "0"]


def test_candidates_give_every_data_parallel_rank_a_sample_of_each_mini_batch():
    from realrl.plan.candidates import strategies

    def data_sizes(**options):
        return sorted({s.data for size in (1, 2, 4, 8)
                       for s in strategies(work(**options), size, 8, False)})

    # 2 prompts x 4 responses: 8 sequences, but a call splits by prompt
    assert data_sizes(kind=WorkKind.generate, num_sequences=8, num_samples=2) == [1, 2]
    assert data_sizes(kind=WorkKind.generate, num_sequences=8) == [1, 2, 4, 8]
    # 8 prompts in 4 mini-batches (2 epochs: 8 optimizer steps): at most 2 ranks
    assert data_sizes(kind=WorkKind.train_step, num_sequences=16, num_samples=8,
                      optimizer_steps=8, epochs=2) == [1, 2]
