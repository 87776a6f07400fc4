"""The launch-time search's disk cache (`realrl.plan.choose.cached_search`) and the cluster it
prices."""

from __future__ import annotations

from types import SimpleNamespace

from plan_fixtures import cluster, device, work

from realrl.plan.choose import cached_search
from realrl.plan.costs import WorkKind
from realrl.plan.search import SearchProblem


def test_a_search_is_cached_per_problem_and_budget_and_read_back_priced_again(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("REALRL_CACHE", str(tmp_path))
    works = {"actor_train": work(WorkKind.train_step, name="actor_train", role="actor"),
             "critic_train": work(WorkKind.train_step, name="critic_train", role="critic")}
    problem = SearchProblem(works, {}, cluster(n_devices_per_node=2))
    first = cached_search(problem, time_budget_s=1.0)
    assert first.evaluations > len(first.plans)  # searched
    assert len(list((tmp_path / "plan").glob("search-*.json"))) == 1
    again = cached_search(problem, time_budget_s=1.0)
    assert again.evaluations == len(again.plans) + 1  # only the cached plans, and symmetric
    assert [p.layouts for p in again.plans] == [p.layouts for p in first.plans]
    assert [p.step_seconds for p in again.plans] == [p.step_seconds for p in first.plans]
    cached_search(problem, time_budget_s=2.0)  # a larger budget searches again
    assert len(list((tmp_path / "plan").glob("search-*.json"))) == 2


def test_cpu_workers_that_outnumber_the_cores_share_them(monkeypatch):
    from realrl.plan import choose

    monkeypatch.setattr(choose, "cpu_device", lambda threads, memory_bytes: device())
    monkeypatch.setattr(choose, "_cores", lambda: 2)

    def config(workers: int, plan_device: str = "auto"):
        return SimpleNamespace(n_nodes=1, n_devices_per_node=workers, worker_memory_gb=None,
                               plan=SimpleNamespace(device=plan_device))

    assert choose.resolve_cluster(config(2), cpu_workers=True).parallel_devices_per_node is None
    assert choose.resolve_cluster(config(4), cpu_workers=True).parallel_devices_per_node == 2
    assert choose.resolve_cluster(config(3), cpu_workers=True).parallel_devices_per_node == 2
    # GPUs are devices of their own, however few cores the launcher has
    gpus = choose.resolve_cluster(config(8, "h100"), cpu_workers=False)
    assert gpus.parallel_devices_per_node is None


def test_ppo_maths_train_forward_sent_ahead_is_priced_as_the_master_runs_it(tmp_path):
    # `ppo.reuse_forward` with one optimizer step a call: the master sends actor_train's
    # forward once actor_gen has made `packed_input_ids` (critic_inf's forward is the critic's
    # training forward: critic_train sends none); not with mini-batches, nor in GRPO without
    # a reference or a critic, where nothing would run beside it.
    import realrl.experiments  # noqa: F401  (registers ppo-math)
    from realrl.api.config import resolve_config
    from realrl.api.registry import get_experiment
    from realrl.launcher.preflight import prepare_launch
    from realrl.plan.workload import graph_works

    def works(*overrides: str):
        entry = get_experiment("ppo-math")
        config = resolve_config(entry.config_class, [f"output_root={tmp_path}", *overrides], [],
                                defaults={"experiment_name": entry.name})
        launch = prepare_launch(config)
        return graph_works(config, launch.spec, launch.graph)[0]

    ppo = works()
    assert ppo["actor_train"].forward_ahead_after == ("actor_gen",)
    assert ppo["critic_train"].forward_ahead_after == ()
    assert works("ppo.num_minibatches=2")["actor_train"].forward_ahead_after == ()
    grpo = works("ppo.disable_value=true", "ppo.adv_estimator=grpo", "ppo.kl_ctl=0")
    assert grpo["actor_train"].forward_ahead_after == ()


def test_the_explorers_ppo_sends_the_actors_forward_ahead_with_one_minibatch_only():
    from realrl.plan.presets import RLWorkload, rl_graph

    one = rl_graph(RLWorkload(ppo_minibatches=1))[0]
    assert one["actor_train"].forward_ahead_after == ("actor_gen",)
    assert one["critic_train"].forward_ahead_after == ()
    assert rl_graph(RLWorkload(ppo_minibatches=4))[0]["actor_train"].forward_ahead_after == ()
