"""Precision and memory as a user meets them through the CLI.

`actor.dtype=bfloat16` alone puts the reference and the critic in bf16 (the resolved config
says so), the README's `actor.optimizer.lr=1e-6` trains the weights (the checkpoint's fp32
masters moved, its bf16 weights are their rounding), and each MFC reports its peak memory.
"""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from e2e_helpers import describe, read_metrics, run_cli
from safetensors.torch import load_file

from realrl.models.checkpoint import load_pretrained

TINY_PPO = [
    "dataset.batch_size=4",
    "group_size=2",
    "gen.max_new_tokens=8",
    "n_devices_per_node=2",
]


def test_dry_run_shows_the_reference_and_critic_in_the_actors_dtype(cli_env):
    result = run_cli("ppo-math", ["--dry-run", "actor.dtype=bfloat16"], cli_env)
    assert result.returncode == 0, describe(result)
    for role in ("actor", "critic", "ref"):
        section = re.search(rf"^{role}:\n((?:  .*\n)+)", result.stdout, re.MULTILINE)
        assert section is not None, result.stdout
        assert "  dtype: bfloat16\n" in section.group(1), (role, section.group(1))
    assert re.search(r"^dtype: float32$", result.stdout, re.MULTILINE)


def _kl_at_step_one(run_dir) -> float:
    return read_metrics(run_dir)[0]["actor_train/kl_to_ref"]


@pytest.fixture(scope="module")
def bf16_settings(tiny_model) -> list[str]:
    """The README's real-model settings on the tiny model (bf16, lr=1e-6), a checkpoint every
    step, on a fixed layout and thread split so that a resumed run can be bit-identical."""
    return [f"actor.path={tiny_model}", *TINY_PPO, "share_idle_cores=false",
            "allocation_mode=actor_gen:d2,actor_train:d1@0,*:d2", "save_freq_steps=1",
            "actor.dtype=bfloat16", "actor.optimizer.lr=1e-6", "worker_memory_gb=0.05",
            "recover_mode=auto"]


@pytest.fixture(scope="module")
def bf16_run(bf16_settings, cli_env, tmp_path_factory):
    """Three straight steps of `bf16_settings`; the run directory."""
    output_root = tmp_path_factory.mktemp("bf16")
    result = run_cli("ppo-math", [*bf16_settings, f"output_root={output_root}",
                                  "total_train_steps=3"], cli_env)
    assert result.returncode == 0, describe(result)
    return output_root / "ppo-math" / "trial0"


@pytest.mark.slow
def test_bf16_actor_trains_at_lr_1e6_with_a_bf16_reference(bf16_settings, bf16_run, tiny_model,
                                                           cli_env, tmp_path):
    """Three steps at lr=1e-6 move the fp32 masters; the bf16 weights saved are their rounding."""
    run_dir = bf16_run
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert [config[role]["dtype"] for role in ("actor", "critic", "ref")] == ["bfloat16"] * 3

    actor_dir = run_dir / "checkpoints" / "step000003" / "actor"
    saved = load_file(actor_dir / "model.safetensors")
    assert {tensor.dtype for tensor in saved.values()} == {torch.bfloat16}
    masters = torch.load(actor_dir / "optimizer.pt", weights_only=False)["master_weights"]
    names = [name for name, _ in load_pretrained(actor_dir).named_parameters()]
    initial = load_pretrained(tiny_model).state_dict()
    moved = total = 0
    for name, master in zip(names, masters, strict=True):
        assert master.dtype == torch.float32
        start = initial[name].to(torch.bfloat16).float()  # what the run loaded
        moved += int((master != start).sum())
        total += master.numel()
    # Every weight with a gradient moved (embedding rows of unused tokens have none).
    assert moved / total > 0.5, (moved, total)
    check_weights_are_rounded_masters(actor_dir, masters)

    metrics = read_metrics(run_dir)
    for mfc in ("actor_gen", "ref_inf", "actor_train", "critic_train"):
        assert 0.05 < metrics[0][f"{mfc}/peak_memory_gb"] < 64, mfc
    # Below what a worker holds before any call: one hint per worker, not one per MFC.
    for log in (run_dir / "logs").glob("worker*.log"):
        assert log.read_text().count("of this worker's 0.05 GB") == 1, log.read_text()[-3000:]
        assert "no token budget helps" in log.read_text()

    # The old behaviour: an fp32 reference against the bf16 policy, the same first step.
    result = run_cli("ppo-math", [*bf16_settings, f"output_root={tmp_path}",
                                  "total_train_steps=1", "ref.dtype=float32"], cli_env)
    assert result.returncode == 0, describe(result)
    bf16_kl = abs(_kl_at_step_one(run_dir))
    mixed_kl = abs(_kl_at_step_one(tmp_path / "ppo-math" / "trial0"))
    assert bf16_kl < mixed_kl / 3, (bf16_kl, mixed_kl)


def check_weights_are_rounded_masters(actor_dir, masters) -> None:
    """realrl loads the checkpoint's bf16 weights in its own parameter order: each is its
    fp32 master rounded to nearest bf16."""
    module = load_pretrained(actor_dir, dtype=torch.bfloat16)
    for (name, weight), master in zip(module.named_parameters(), masters, strict=True):
        assert torch.equal(weight, master.to(torch.bfloat16)), name


@pytest.mark.slow
def test_bf16_resume_continues_from_the_saved_fp32_masters(bf16_settings, bf16_run, cli_env,
                                                           tmp_path):
    """Two steps, then a resumed third, end bit-identical to three straight steps: the
    checkpoint carries the masters, which at lr=1e-6 hold what the bf16 weights cannot."""
    for steps in (2, 3):
        result = run_cli("ppo-math", [*bf16_settings, f"output_root={tmp_path}",
                                      f"total_train_steps={steps}"], cli_env)
        assert result.returncode == 0, describe(result)
    resumed_dir = tmp_path / "ppo-math" / "trial0"
    assert "resumed from" in (resumed_dir / "logs" / "master.log").read_text()
    final = {}
    for name, run_dir in (("straight", bf16_run), ("resumed", resumed_dir)):
        actor_dir = run_dir / "checkpoints" / "step000003" / "actor"
        final[name] = (
            torch.load(actor_dir / "optimizer.pt", weights_only=False)["master_weights"],
            load_file(actor_dir / "model.safetensors"),
        )
    (straight_masters, straight_weights), (resumed_masters, resumed_weights) = final.values()
    assert all(torch.equal(a, b) for a, b in zip(straight_masters, resumed_masters, strict=True))
    assert all(torch.equal(straight_weights[k], resumed_weights[k]) for k in straight_weights)
    # The masters hold more than their bf16 rounding: a resume from the weights alone differs.
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in straight_masters)
