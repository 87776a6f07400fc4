"""The plan-search benchmark's bookkeeping: which allocation a row's runs measured, and its
table's columns."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_plan_search import measured_plan, table  # noqa: E402


def row(plan: str, resolved: str, steals, **extra) -> dict:
    return {"experiment": "ppo", "plan": plan, "resolved": resolved, "predicted_s": 0.2,
            "measured_s": 0.25, "runs_s": [0.25, 0.3], "steals": steals, "load": 2.5,
            "loads": [2.5, 2.4], "predicted_unshared_s": None, **extra}


def test_a_search_row_is_priced_as_the_plan_its_runs_measured():
    assert measured_plan(row("search", "actor_gen:d1t1p1@0", [0.1])) == "actor_gen:d1t1p1@0"
    assert measured_plan(row("d2", "actor_gen:d2t1p1@0-1", [0.1])) == "d2"


def test_the_table_shows_both_predictions_the_steal_and_the_search_made_again():
    rows = [row("search", "a:d1t1p1@0", [0.02, 0.11], predicted_profile_s=0.19,
                searched_again="a:d1t1p1@1", searched_again_s=0.18),
            row("d2", "a:d2t1p1@0-1", [0.01, 0.03], predicted_profile_s=0.3)]
    text = table(rows)
    assert "| `search` | `a:d1t1p1@0` | 0.200 | 0.250 (0.250, 0.300) | -20% | 0.190 | -24% | 11% |" \
        in text
    assert "searched again with the fit to every run: a different plan, `a:d1t1p1@1` " \
        "(predicted 0.180 s)" in text
    # a run whose steal could not be read: the load average instead
    unread = table([row("d2", "a:d2t1p1@0-1", [None, 0.03])])
    assert "| load |" in unread and "| 2.5 |" in unread
