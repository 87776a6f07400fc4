"""Calls side by side on one machine's workers slow each other (`Cluster.contention`), and the
side-by-side probe's step gives how much (`realrl.plan.contention`): hand-computed cases."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
from plan_fixtures import cluster, layout, work

from realrl.api.allocation_mode import parse_allocation_mode
from realrl.apps.profile_plan import calibrate_from_runs, side_by_side_allocation
from realrl.plan import calibration as cal
from realrl.plan.contention import fit_contention, side_by_side_layouts, with_contention
from realrl.plan.costs import WorkKind
from realrl.plan.search import Evaluator, SearchProblem

# TINY inference of 3 sequences x (2 + 2) tokens on the paper device: 31.104 s on one rank
# (test_plan_calibration).
ONE_RANK_S = 31.104


def test_busy_devices_of_a_node_slow_each_other_by_the_contention():
    machine = dataclasses.replace(cluster(n_devices_per_node=2), contention=0.5)
    assert machine.speed(Counter({0: 1}), (0,)) == 1.0
    assert machine.speed(Counter({0: 2}), (0,)) == pytest.approx(1 / 1.5)
    # 4 workers on 2 cores: half the cores each, and 2 (not 4) devices' worth of contention
    shared = dataclasses.replace(cluster(), parallel_devices_per_node=2, contention=0.5)
    assert shared.speed(Counter({0: 4}), (0, 1)) == pytest.approx(0.5 / 1.5)
    assert shared.speed(Counter({0: 2}), (0, 1)) == pytest.approx(1 / 1.5)
    assert not cluster().devices_interfere and machine.devices_interfere


def two_rule_calls(contention: float) -> SearchProblem:
    """a (1 s) on device 0 and b (2 s) on device 1, independent, taking exactly those seconds
    at full speed (a calibration of scale 0 and that offset)."""
    works = {name: work(WorkKind.rule, name=name, role=name, model=None) for name in "ab"}
    corrections = (("a", cal.MFCCorrection(0.0, 1.0)), ("b", cal.MFCCorrection(0.0, 2.0)))
    return SearchProblem(works, {}, dataclasses.replace(cluster(n_devices_per_node=2),
                                                        contention=contention),
                         calibration=cal.Calibration(corrections))


SIDE_BY_SIDE = {"a": layout([0], per_node=2), "b": layout([1], per_node=2)}


def test_two_calls_side_by_side_run_slower_until_one_ends():
    # Contention 0.5: both at 1 / 1.5 of full speed, so a ends at 1.5 s with b half done; b
    # then runs alone, at full speed, for its last second: 2.5 s (2 s without contention).
    plan = Evaluator(two_rule_calls(0.5)).plan(SIDE_BY_SIDE)
    assert plan.step_seconds == pytest.approx(2.5)
    assert [(entry.name, entry.start_s, entry.finish_s) for entry in plan.timeline] == \
        [("a", 0.0, pytest.approx(1.5)), ("b", 0.0, pytest.approx(2.5))]
    assert Evaluator(two_rule_calls(0.0)).plan(SIDE_BY_SIDE).step_seconds == pytest.approx(2.0)


def test_the_contention_is_the_smallest_that_gives_the_probe_its_measured_step():
    problem = two_rule_calls(0.0)
    corrections = problem.calibration
    assert corrections is not None
    for measured, expected in ((2.5, 0.5), (2.0, 0.0), (1.9, 0.0), (2.3, 0.3)):
        fitted = fit_contention(problem, lambda _: corrections, SIDE_BY_SIDE, measured)
        assert fitted.contention == pytest.approx(expected, abs=0.005)
        assert fitted.corrections == corrections.corrections


def test_the_per_mfc_fit_is_made_again_at_the_contention_that_also_slowed_the_probes():
    # Truth: seconds = 2 x compute + 5 s at full speed, contention 0.25. The d1 probe ran alone
    # (67.208 s); the d2 probe's two workers slowed each other (20.552 x 1.25); the
    # side-by-side probe ran ref_inf and critic_inf at once on workers 0 and 1: 67.208 x 1.25.
    works = {name: work(WorkKind.inference, name=name, role=name.split("_")[0])
             for name in ("ref_inf", "critic_inf")}
    problem = SearchProblem(works, {}, cluster(n_devices_per_node=2))
    d1, d2 = layout([0], per_node=2), layout([0, 1], data=2, per_node=2)
    alone, split = 2 * ONE_RANK_S + 5, (2 * ONE_RANK_S / 2 + 5) * 1.25
    samples = {name: [cal.ProbeSample(d1, alone), cal.ProbeSample(d2, split)] for name in works}
    side = {"ref_inf": layout([0], per_node=2), "critic_inf": layout([1], per_node=2)}
    fitted = fit_contention(problem, lambda machine: cal.fit(works, machine, samples), side,
                            alone * 1.25)
    assert fitted.contention == pytest.approx(0.25)
    correction = fitted.correction("ref_inf")
    assert correction is not None
    assert (correction.scale, correction.offset_s) == (pytest.approx(2.0), pytest.approx(5.0))
    # the d2 probe is predicted as it was measured, and a plan alone at full speed
    calibrated = Evaluator(dataclasses.replace(with_contention(problem, fitted.contention),
                                               calibration=fitted))
    assert calibrated.plan({"ref_inf": d2, "critic_inf": layout([1], per_node=2)}
                           ).timeline[0].run_s == pytest.approx(split)


def ppo_graph(n_devices: int) -> SearchProblem:
    works = {
        "actor_gen": work(WorkKind.generate, name="actor_gen", role_is_trained=True),
        "critic_inf": work(WorkKind.inference, name="critic_inf", role="critic"),
        "ref_inf": work(WorkKind.inference, name="ref_inf", role="ref"),
        "rew_inf": work(WorkKind.rule, name="rew_inf", role="reward", model=None),
        "actor_train": work(WorkKind.train_step, name="actor_train", role_is_trained=True),
        "critic_train": work(WorkKind.train_step, name="critic_train", role="critic",
                             role_is_trained=True),
    }
    after_gen = ("actor_gen",)
    dependencies = {"critic_inf": after_gen, "ref_inf": after_gen, "rew_inf": after_gen,
                    "actor_train": ("critic_inf", "ref_inf", "rew_inf"),
                    "critic_train": ("critic_inf", "ref_inf", "rew_inf")}
    return SearchProblem(works, dependencies, cluster(n_devices_per_node=n_devices))


def test_the_side_by_side_probe_alternates_the_roles_over_the_two_halves_of_the_workers():
    two = ppo_graph(2)
    assert side_by_side_allocation(two) == (
        "actor_gen:d1t1p1@0,critic_inf:d1t1p1@1,ref_inf:d1t1p1@0,rew_inf:d1t1p1@1,"
        "actor_train:d1t1p1@0,critic_train:d1t1p1@1")
    layouts = side_by_side_layouts(ppo_graph(4))
    assert layouts is not None
    assert {name: (layout.mesh.ranks, layout.strategy.data) for name, layout in layouts.items()} \
        == {"actor_gen": ((0, 1), 2), "critic_inf": ((2, 3), 2), "ref_inf": ((0, 1), 2),
            "rew_inf": ((2, 3), 2), "actor_train": ((0, 1), 2), "critic_train": ((2, 3), 2)}
    mode = side_by_side_allocation(ppo_graph(4))
    assert mode is not None
    parsed = parse_allocation_mode(mode, list(layouts), 1, 4)
    assert all(parsed[name].mesh == layouts[name].mesh for name in layouts)
    assert side_by_side_allocation(ppo_graph(3)) is None  # no two halves
    assert side_by_side_allocation(ppo_graph(1)) is None


def test_no_side_by_side_probe_where_no_two_calls_can_overlap():
    # GRPO without a reference: generation, its rule reward, the train call, in a chain
    works = {"actor_gen": work(WorkKind.generate, name="actor_gen", role_is_trained=True),
             "rew_inf": work(WorkKind.rule, name="rew_inf", role="reward", model=None),
             "actor_train": work(WorkKind.train_step, name="actor_train",
                                 role_is_trained=True)}
    chain = SearchProblem(works, {"rew_inf": ("actor_gen",), "actor_train": ("rew_inf",)},
                          cluster(n_devices_per_node=2))
    assert side_by_side_layouts(chain) is None


def test_probe_runs_give_the_corrections_and_the_contention_and_it_is_saved(tmp_path,
                                                                            monkeypatch):
    # The two-inference case above, from metrics.jsonl files as the probe runs write them
    # (their first step a warm-up), through the calibration cache.
    monkeypatch.setenv("REALRL_CACHE", str(tmp_path / "cache"))
    works = {name: work(WorkKind.inference, name=name, role=name.split("_")[0])
             for name in ("ref_inf", "critic_inf")}
    problem = SearchProblem(works, {}, cluster(n_devices_per_node=2))
    alone, split = 2 * ONE_RANK_S + 5, (2 * ONE_RANK_S / 2 + 5) * 1.25

    def run(name: str, seconds: dict[str, float], step: float):
        path = tmp_path / name / "metrics.jsonl"
        path.parent.mkdir()
        record = {"timing/step_s": step} | {f"timing/{mfc}": s for mfc, s in seconds.items()}
        path.write_text(json.dumps({"timing/step_s": 99.0}) + "\n" + json.dumps(record) + "\n")
        return [path]

    side = side_by_side_allocation(problem)
    assert side == "ref_inf:d1t1p1@0,critic_inf:d1t1p1@1"
    runs = [run("probe0", {"ref_inf": alone, "critic_inf": alone}, 2 * alone),
            run("probe1", {"ref_inf": split, "critic_inf": split}, 2 * split),
            run("probe2", {"ref_inf": alone * 1.25, "critic_inf": alone * 1.25}, alone * 1.25)]
    calibration = calibrate_from_runs(problem, ["*:d1@0", "d2"], side, runs)
    assert calibration.contention == pytest.approx(0.25)
    cal.save_calibration(works, problem.cluster, calibration)
    loaded = cal.load_calibration(works, problem.cluster)
    assert loaded is not None and loaded.contention == pytest.approx(0.25)
    assert loaded.corrections == calibration.corrections
    assert calibrate_from_runs(problem, ["*:d1@0", "d2"], None, runs[:2]).contention == 0.0
