"""Per-MFC calibration of the cost model from probe runs (`realrl.plan.calibration`) and the
pieces of `python -m realrl.apps.profile_plan` that need no run."""

from __future__ import annotations

import dataclasses
import json

import pytest
from plan_fixtures import TINY, cluster, layout, work

from realrl.apps.profile_plan import (
    _user_overrides,
    measured_mfc_seconds,
    median_over_runs,
    probe_allocations,
    probe_trial,
)
from realrl.plan import calibration as cal
from realrl.plan.costs import ModelShape, WorkKind, compute_seconds, mfc_seconds
from realrl.plan.search import Evaluator, SearchProblem

# TINY inference of 3 sequences x (2 + 2) tokens: a forward costs per token the layers'
# 2 * 2 * 576 = 2304 FLOPs, attention 4 * 2 * 8 * 2 = 128 (a context of 4 / 2 keys) and the
# head 2 * 80 = 160, so 2592 FLOPs; 12 tokens at 1000 FLOP/s: 31.104 s on one rank.
ONE_RANK_S = 31.104


def inference():
    return work(WorkKind.inference, name="ref_inf", role="ref")


def test_compute_of_the_hand_sized_inference_is_31_1_seconds():
    assert compute_seconds(inference(), layout([0]), cluster().device) == pytest.approx(ONE_RANK_S)
    assert compute_seconds(inference(), layout([0, 1], data=2), cluster().device) == \
        pytest.approx(ONE_RANK_S / 2)


def test_two_probes_give_scale_and_offset_and_a_tensor_probe_its_own_offset():
    mfc, machine = inference(), cluster()
    d1, d2, t2 = layout([0]), layout([0, 1], data=2), layout([0, 1], tensor=2)
    # measured = 2 x compute + 5 s (tp = 1), + 9 s and the ring all-reduces with tp = 2
    tp_comm = cal.communication_seconds(mfc, t2, machine)
    # 2 layers x 2 all-reduces of 3 x 4 x 8 x 4 = 384 bytes, each 2 x 0.5 s + 384 / 100 s
    assert tp_comm == pytest.approx(2 * 2 * (2 * 0.5 + 384 / 100))
    samples = [cal.ProbeSample(d1, 2 * ONE_RANK_S + 5), cal.ProbeSample(d2, ONE_RANK_S + 5),
               cal.ProbeSample(t2, ONE_RANK_S + 9 + tp_comm)]
    correction = cal.fit_correction(mfc, machine, samples)
    assert correction.scale == pytest.approx(2.0)
    assert correction.offset_s == pytest.approx(5.0)
    assert dict(correction.tensor_offsets_s) == {2: pytest.approx(9.0)}
    # a layout no probe ran: d4 takes the tp = 1 fit, 2 x 7.776 + 5
    d4 = layout([0, 1, 2, 3], data=4)
    assert cal.corrected_seconds(mfc, d4, machine, correction) == pytest.approx(20.552)
    assert cal.corrected_seconds(mfc, d4, machine, None) == mfc_seconds(mfc, d4, machine)
    # t4 was not probed either: the tp = 1 offset, with t4's own all-reduces
    t4 = layout([0, 1, 2, 3], tensor=4)
    assert cal.corrected_seconds(mfc, t4, machine, correction) == pytest.approx(
        2 * ONE_RANK_S / 4 + 5 + cal.communication_seconds(mfc, t4, machine))


def test_a_noisy_or_degenerate_pair_falls_back_to_a_nonnegative_or_unit_scale():
    mfc, machine = inference(), cluster()
    d1, d2 = layout([0]), layout([0, 1], data=2)
    # more compute measured faster: the slope is clamped at 0, the offset is the mean
    falling = cal.fit_correction(mfc, machine, [cal.ProbeSample(d1, 10.0),
                                                cal.ProbeSample(d2, 12.0)])
    assert falling.scale == 0.0 and falling.offset_s == pytest.approx(11.0)
    # one probe (a one-worker cluster): scale 1, the residual as offset
    single = cal.fit_correction(mfc, machine, [cal.ProbeSample(d1, ONE_RANK_S + 3)])
    assert single.scale == 1.0 and single.offset_s == pytest.approx(3.0)
    with pytest.raises(ValueError, match="no probe without tensor parallelism"):
        cal.fit_correction(mfc, machine, [cal.ProbeSample(layout([0, 1], tensor=2), 1.0)])


def test_the_evaluator_prices_calibrated_mfcs_and_leaves_the_others_to_the_model():
    gen = work(WorkKind.generate, name="actor_gen", role="actor")
    ref = inference()
    works = {"actor_gen": gen, "ref_inf": ref}
    machine = cluster(n_devices_per_node=2)
    correction = cal.MFCCorrection(scale=0.5, offset_s=1.0)
    problem = SearchProblem(works, {"ref_inf": ("actor_gen",)}, machine,
                            calibration=cal.Calibration((("ref_inf", correction),)))
    layouts = {"actor_gen": layout([0], per_node=2), "ref_inf": layout([0], per_node=2)}
    plan = Evaluator(problem).plan(layouts)
    generate_s = mfc_seconds(gen, layouts["actor_gen"], machine)
    assert plan.step_seconds == pytest.approx(generate_s + 0.5 * ONE_RANK_S + 1.0)


def test_probes_on_more_workers_than_cores_are_fitted_at_full_speed_and_predicted_as_measured():
    # 4 workers on 2 cores: the d4 probe ran every worker at half speed, the d1 probe at full.
    # measured = 2 x compute + 5 s at full speed; the d4 probe took twice its full-speed time.
    mfc = inference()
    machine = dataclasses.replace(cluster(), parallel_devices_per_node=2)
    d1, d4 = layout([0]), layout([0, 1, 2, 3], data=4)
    assert machine.solo_speed(d1.mesh.ranks) == 1.0 and machine.solo_speed(d4.mesh.ranks) == 0.5
    d4_measured = 2 * (2 * ONE_RANK_S / 4 + 5)
    correction = cal.fit_correction(mfc, machine, [cal.ProbeSample(d1, 2 * ONE_RANK_S + 5),
                                                   cal.ProbeSample(d4, d4_measured)])
    assert correction.scale == pytest.approx(2.0) and correction.offset_s == pytest.approx(5.0)
    # the search prices the d4 call alone at half speed again: the probe's own measurement
    problem = SearchProblem({"ref_inf": mfc}, {}, machine,
                            calibration=cal.Calibration((("ref_inf", correction),)))
    assert Evaluator(problem).plan({"ref_inf": d4}).step_seconds == pytest.approx(d4_measured)


def test_a_calibration_is_cached_per_workload_and_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("REALRL_CACHE", str(tmp_path))
    works, machine = {"ref_inf": inference()}, cluster(n_devices_per_node=2)
    calibration = cal.Calibration((("ref_inf", cal.MFCCorrection(2.0, 5.0, ((2, 9.0),))),))
    path = cal.save_calibration(works, machine, calibration)
    assert path.parent == tmp_path / "plan" and path.name.startswith("calibration-")
    loaded = cal.load_calibration(works, machine)
    assert loaded is not None and loaded.corrections == calibration.corrections
    assert loaded.source == str(path)
    other_batch = {"ref_inf": work(WorkKind.inference, name="ref_inf", role="ref",
                                   num_sequences=6)}
    assert cal.load_calibration(other_batch, machine) is None
    assert cal.load_calibration(works, cluster(n_devices_per_node=4)) is None
    path.write_text(json.dumps({**json.loads(path.read_text()), "version": 0}))
    assert cal.load_calibration(works, machine) is None  # an older format is measured again


def test_measured_seconds_skip_the_warm_up_step_and_add_the_forward_sent_ahead(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    steps = [{"timing/step_s": 9.0, "timing/actor_train": 5.0, "timing/actor_train/forward": 4.0},
             {"timing/step_s": 1.0, "timing/actor_train": 0.5, "timing/actor_train/forward": 0.2},
             {"timing/step_s": 3.0, "timing/actor_train": 0.7, "timing/actor_train/forward": 0.2},
             {"timing/step_s": 2.0, "timing/actor_train": 0.6, "timing/actor_train/forward": 0.1}]
    metrics.write_text("".join(json.dumps(step) + "\n" for step in steps))
    seconds, step = measured_mfc_seconds(metrics, ["actor_train", "critic_train"])
    assert seconds == {"actor_train": pytest.approx(0.7)} and step == 2.0


def test_repeated_probe_runs_are_summarised_by_each_mfcs_median_over_the_runs():
    runs = [({"actor_gen": 0.045, "actor_train": 0.10}, 0.16),
            ({"actor_gen": 0.068, "actor_train": 0.12}, 0.20),  # a slow run
            ({"actor_gen": 0.047}, 0.15)]  # a run that did not time the train call
    seconds, step = median_over_runs(runs)
    assert seconds == {"actor_gen": 0.047, "actor_train": pytest.approx(0.11)} and step == 0.16
    assert median_over_runs(runs[:1]) == runs[0]
    assert [probe_trial(1, repeat) for repeat in range(3)] == \
        ["probe1", "probe1-run2", "probe1-run3"]


def test_probes_are_one_worker_all_data_parallel_and_tensor_parallel_where_every_mfc_splits():
    splittable = ModelShape(num_layers=2, hidden_size=8, intermediate_size=16,
                            num_attention_heads=2, num_key_value_heads=2, vocab_size=10)
    works = {"actor_gen": work(WorkKind.generate, name="actor_gen", model=splittable),
             "rew_inf": work(WorkKind.rule, name="rew_inf", role="reward", model=None)}
    two = SearchProblem(works, {}, cluster(n_devices_per_node=2))
    assert probe_allocations(two) == ["*:d1@0", "d2", "d1t2"]
    unsplittable = {**works, "ref_inf": inference()}  # TINY has one key/value head
    assert probe_allocations(SearchProblem(unsplittable, {}, cluster(n_devices_per_node=2))) \
        == ["*:d1@0", "d2"]
    assert probe_allocations(SearchProblem(works, {}, cluster(n_devices_per_node=1))) == \
        ["*:d1@0"]
    assert TINY.num_key_value_heads == 1


def test_the_probes_own_keys_replace_the_users():
    assert _user_overrides(["allocation_mode=search", "gen.max_new_tokens=16",
                            "total_train_steps=400", "+trial_name=x", "seed=3"]) == \
        ["gen.max_new_tokens=16", "seed=3"]


def test_profile_plan_refuses_bad_input_before_any_probe_runs(capsys, tmp_path):
    from realrl.apps.profile_plan import main

    work_dir = tmp_path / "probes"
    assert main(["ppo-math", "--steps", "1", "--work-dir", str(work_dir)]) == 2
    assert "--steps must be at least 2" in capsys.readouterr().err
    assert main(["ppo-math", "--repeats", "0", "--work-dir", str(work_dir)]) == 2
    assert "--repeats 0: give at least 1 run per probe" in capsys.readouterr().err
    assert main(["ppo-math", "gen.max_new_tokenz=4", "--work-dir", str(work_dir)]) == 2
    assert "gen.max_new_tokenz" in capsys.readouterr().err
    assert main(["no-such-experiment", "--work-dir", str(work_dir)]) == 2
    assert "no-such-experiment" in capsys.readouterr().err
    assert not work_dir.exists()  # nothing ran
