"""ppo-math through the real CLI on 2 CPU workers, with several allocations.

Checks what a user is promised: exit code 0 and a run directory with the resolved config, the
plan, the graph, per-process logs, one metrics line per step, a few decoded samples, a plot,
and a final checkpoint that plain `transformers` loads with the same logits as realrl's own
loader.
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
    # the data-parallel generation layout every step, and the checkpoint holds full weights. On
    # a Qwen3 actor (`tiny_qwen3_model`): its per-head norms' gradients are summed over the two
    # ranks, each of which holds half the heads.
    pytest.param(["allocation_mode=actor_gen:d2,actor_train:d1t2,*:d2", "qwen3"],
                 id="qwen3_gen_d2_train_t2"),
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
def test_ppo_math_runs_two_steps_on_two_workers(allocation, request, cli_env, tmp_path):
    qwen3 = "qwen3" in allocation
    model = request.getfixturevalue("tiny_qwen3_model" if qwen3 else "tiny_model")
    allocation = [key for key in allocation if key != "qwen3"]
    result = run_cli(
        "ppo-math",
        [f"actor.path={model}", f"output_root={tmp_path}", *SMALL_PPO, *allocation],
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
        assert record["reward/task_mean"] == record["rew_inf/task_mean"]  # no rollout filter
    # Not a terminal: every progress line in full, as in logs/master.log.
    progress = [line for line in result.stdout.splitlines() if line.startswith("[master] step ")]
    assert [line.split(" | ")[0] for line in progress] == ["[master] step 1/2",
                                                           "[master] step 2/2"]
    assert all(line.removeprefix("[master] ") in (run_dir / "logs/master.log").read_text()
               for line in progress)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [sample["step"] for sample in samples] == [1] * 4  # log.samples_* defaults: 4 on step 1
    for sample in samples:
        assert {"query_id", "prompt", "response", "reward", "answer"} <= set(sample)
        assert "=" in sample["prompt"] and 0.0 <= sample["reward"] <= 1.0

    disables_critic = "ppo.disable_value=true" in allocation
    checkpoint = run_dir / "checkpoints" / "step000002"
    assert (checkpoint / "critic").is_dir() != disables_critic
    check_transformers_loads_the_same_logits(checkpoint / "actor")
    saved = json.loads((checkpoint / "actor" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3ForCausalLM" if qwen3 else "Qwen2ForCausalLM"]


def test_forwards_run_ahead_train_exactly_as_the_plain_order(tiny_model, cli_env, tmp_path):
    """`ppo.reuse_forward`: actor_train's forward goes out beside ref_inf and critic_inf, and
    critic_train trains on critic_inf's forward; same losses and rewards, bit for bit.

    Both runs keep the even split of the cores: a lent core changes a worker's thread count
    with timing, and with it the rounding of float sums (a loaded CI machine saw step 2's
    near-zero loss differ in the 8th decimal)."""
    layout = "actor_gen:d2,rew_inf:d2,ref_inf:d2,critic_inf:d1@1,actor_train:d1@0,critic_train:d1@1"
    runs = {}
    for reuse in ("true", "false"):
        result = run_cli(
            "ppo-math",
            [f"actor.path={tiny_model}", f"output_root={tmp_path / reuse}", *SMALL_PPO,
             f"allocation_mode={layout}", f"ppo.reuse_forward={reuse}", "share_idle_cores=false"],
            cli_env,
        )
        assert result.returncode == 0, describe(result)
        runs[reuse] = read_metrics(tmp_path / reuse / "ppo-math" / "trial0")
    for reuse, metrics in runs.items():
        for record in metrics:
            expected = 1.0 if reuse == "true" else 0.0
            assert record["actor_train/forward_reused"] == expected
            assert record["critic_train/forward_reused"] == expected
            assert ("timing/actor_train/forward" in record) == (reuse == "true")
    for key in ("rew_inf/task_mean", "actor_train/loss", "actor_train/kl_to_ref",
                "actor_train/entropy", "critic_train/value_loss", "actor_train/grad_norm",
                "critic_train/grad_norm"):
        assert [r[key] for r in runs["true"]] == [r[key] for r in runs["false"]], key


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


def test_pipelined_rollout_trains_one_step_behind_and_stops_at_checkpoints(
    tiny_model, cli_env, tmp_path
):
    """`pipeline_rollout=true` (auto allocation: generation on worker 0, training on worker 1).

    Each rollout after the first is generated by weights one train step old, except right after
    a checkpoint: no rollout runs ahead of one, so its data position is exact and a resumed run
    pipelines again from there.
    """
    overrides = [
        f"actor.path={tiny_model}", f"output_root={tmp_path}", *SMALL_PPO,
        "ppo.disable_value=true", "ppo.adv_estimator=grpo", "pipeline_rollout=true",
        "total_train_steps=4", "save_freq_steps=2",
    ]
    result = run_cli("ppo-math", overrides, cli_env)
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "ppo-math" / "trial0"
    metrics = read_metrics(run_dir)
    assert [record["actor_train/policy_lag"] for record in metrics] == [0, 1, 0, 1]
    # Every later rollout got the train worker's newest weights before it started.
    assert all(record["timing/realloc/actor_gen"] > 0 for record in metrics[1:])
    assert all(record["timing/rollout_wait_s"] >= 0 for record in metrics)
    for step in (2, 4):
        master = json.loads((run_dir / "checkpoints" / f"step{step:06d}" / "master.json").read_text())
        assert master["data"]["position"] == step * 4  # dataset.batch_size=4: no batch skipped

    resumed = run_cli("ppo-math", [*overrides, "total_train_steps=6", "recover_mode=auto"], cli_env)
    assert resumed.returncode == 0, describe(resumed)
    metrics = read_metrics(run_dir)
    assert [record["step"] for record in metrics][-2:] == [5, 6]
    assert [record["actor_train/policy_lag"] for record in metrics][-2:] == [0, 1]
