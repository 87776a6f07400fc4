"""ppo-math through the real CLI on 2 CPU workers, with several allocations.

Checks what a user is promised: exit code 0 and a run directory with the resolved config, the
plan, the graph, per-process logs, one metrics line per step, a plot, and a final checkpoint
that plain `transformers` loads with the same logits as realrl's own loader.
"""

from __future__ import annotations

import json

import pytest
import torch
from e2e_helpers import describe, read_metrics, run_cli

from realrl.models.checkpoint import load_pretrained

SMALL_PPO = [
    "dataset.batch_size=4",
    "group_size=2",
    "gen.max_new_tokens=8",
    "total_train_steps=2",
    "n_devices_per_node=2",
]

ALLOCATIONS = [
    # Generation data-parallel over both workers, training on worker 0 alone: the actor's
    # weights move from the d1 training layout to the d2 generation layout every step.
    pytest.param(["allocation_mode=actor_gen:d2,actor_train:d1@0,*:d2"], id="gen_d2_train_d1"),
    # Tensor-parallel training over both workers: the actor's shards are gathered and moved to
    # the data-parallel generation layout every step, and the checkpoint holds full weights.
    pytest.param(["allocation_mode=actor_gen:d2,actor_train:d1t2,*:d2"], id="gen_d2_train_t2"),
    # Critic-free GRPO, every MFC data-parallel over both workers.
    pytest.param(
        ["allocation_mode=d2", "ppo.disable_value=true", "ppo.adv_estimator=grpo"],
        id="grpo_d2",
        marks=pytest.mark.slow,
    ),
    # Generation on worker 1 alone while everything else spans both workers.
    pytest.param(
        ["allocation_mode=actor_gen:d1@1,*:d2"], id="gen_on_worker1", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_ppo_math_runs_two_steps_on_two_workers(allocation, tiny_model, cli_env, tmp_path):
    result = run_cli(
        "ppo-math",
        [f"actor.path={tiny_model}", f"output_root={tmp_path}", *SMALL_PPO, *allocation],
        cli_env,
    )
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "ppo-math" / "trial0"
    assert f"run directory: {run_dir}" in result.stdout

    for name in (
        "config.yaml",
        "plan.json",
        "graph.mmd",
        "metrics.png",
        "logs/master.log",
        "logs/worker0.log",
        "logs/worker1.log",
    ):
        assert (run_dir / name).is_file(), f"{name} missing from {sorted(run_dir.rglob('*'))}"
    assert "allocation_mode" in (run_dir / "config.yaml").read_text()
    plan = json.loads((run_dir / "plan.json").read_text())
    assert "actor_gen" in plan["allocations"] and "actor_train" in plan["allocations"]
    assert "actor_gen" in (run_dir / "graph.mmd").read_text()

    metrics = read_metrics(run_dir)
    assert [record["step"] for record in metrics] == [1, 2]
    for record in metrics:
        assert 0.0 <= record["reward/task_mean"] <= 1.0
        assert record["timing/step_s"] > 0.0

    disables_critic = "ppo.disable_value=true" in allocation
    checkpoint = run_dir / "checkpoints" / "step000002"
    assert (checkpoint / "critic").is_dir() != disables_critic
    check_transformers_loads_the_same_logits(checkpoint / "actor")


def check_transformers_loads_the_same_logits(directory) -> None:
    """The checkpoint is a plain HF directory: transformers and realrl give the same logits."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
    ours = load_pretrained(directory).eval()
    generator = torch.Generator().manual_seed(0)
    sequence = torch.randint(0, hf_model.config.vocab_size, (12,), generator=generator)
    with torch.no_grad():
        hf_logits = hf_model(sequence[None]).logits[0]  # [12, vocab]
        our_logits = ours(sequence, torch.tensor([0, 12], dtype=torch.int32))  # [12, vocab]
    torch.testing.assert_close(our_logits, hf_logits, rtol=1e-5, atol=1e-5)
