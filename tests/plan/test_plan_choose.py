"""The launch-time search's disk cache (`realrl.plan.choose.cached_search`)."""

from __future__ import annotations

from plan_fixtures import cluster, work

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
