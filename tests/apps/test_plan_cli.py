"""`python -m realrl.apps.plan`: plans for a hypothetical cluster, in seconds, without torch."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

from realrl.apps import plan

SMALL = ["--n-nodes", "1", "--n-devices-per-node", "4", "--actor", "0.5b", "--critic", "0.5b",
         "--prompts", "64", "--generated-tokens", "32", "--time-budget-s", "0.5"]


def test_the_explorer_prints_the_best_plans_their_timelines_and_why_the_runner_up_lost():
    out = io.StringIO()
    assert plan.main(SMALL, out=out) == 0
    text = out.getvalue()
    assert "device: h100, 1 node(s) x 4" in text
    assert text.count("allocation_mode='actor_gen:") == 3  # --show 3
    for name in ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train"):
        assert f"\n  {name} " in text
    assert "symmetric layout" in text and "why #2 lost: the runner-up " in text
    assert "predicted throughput:" in text


def test_grpo_has_a_rule_reward_and_no_critic():
    out = io.StringIO()
    assert plan.main([*SMALL, "--algorithm", "grpo"], out=out) == 0
    text = out.getvalue()
    assert "\n  reward " in text and "critic_train" not in text


def test_the_table_has_one_row_per_size_and_device_count():
    out = io.StringIO()
    assert plan.main(["--table", "--sizes", "0.5b", "--gpus", "8,16", "--prompts", "64",
                      "--generated-tokens", "16", "--time-budget-s", "0.3"], out=out) == 0
    rows = [line for line in out.getvalue().splitlines() if line.startswith("| 0.5b+0.5b")]
    assert [row.split("|")[2].strip() for row in rows] == ["8", "16"]


def test_an_unknown_model_size_names_the_known_ones(capsys):
    assert plan.main(["--actor", "9b"]) == 2
    assert "unknown model size '9b'; known: tiny, 0.5b, 7b" in capsys.readouterr().err


def test_the_explorer_imports_no_torch():
    script = textwrap.dedent(f"""
        import io, sys
        from realrl.apps import plan
        plan.main({SMALL!r}, out=io.StringIO())
        print("torch imported:", "torch" in sys.modules)
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch imported: False" in result.stdout
