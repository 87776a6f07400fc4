"""The engine's training options through the real CLI: activation checkpointing and the
optimizer backend.

`model.gradient_checkpointing=true` recomputes the blocks in the backward: the run logs the
same losses and gradient norms as one that stores the activations. `optimizer.backend=megatron`
needs CUDA workers: on a machine without a GPU the launcher refuses it before any process
starts, naming the key and both ways out, without a traceback.
"""

from __future__ import annotations

from e2e_helpers import describe, read_metrics, run_cli

STEPS = 2


def sft_run(tiny_model, cli_env, output_root, *overrides: str):
    return run_cli(
        "sft",
        [f"model.path={tiny_model}", f"output_root={output_root}", f"total_train_steps={STEPS}",
         "dataset.batch_size=4", *overrides],
        cli_env,
    )


def test_gradient_checkpointing_logs_the_same_losses_and_norms(tiny_model, cli_env, tmp_path):
    runs = {}
    for name, overrides in (("stored", []), ("recomputed", ["model.gradient_checkpointing=true"])):
        result = sft_run(tiny_model, cli_env, tmp_path / name, *overrides)
        assert result.returncode == 0, describe(result)
        runs[name] = read_metrics(tmp_path / name / "sft" / "trial0")
    assert len(runs["stored"]) == len(runs["recomputed"]) == STEPS
    for stored, recomputed in zip(runs["stored"], runs["recomputed"], strict=True):
        for key in ("trainDefault/loss", "trainDefault/grad_norm"):
            assert abs(stored[key] - recomputed[key]) <= 1e-5 * abs(stored[key]), key


def test_megatron_backend_without_a_gpu_is_refused_before_any_process_starts(
    tiny_model, cli_env, tmp_path
):
    result = sft_run(tiny_model, cli_env, tmp_path / "runs", "model.optimizer.backend=megatron")
    assert result.returncode == 2, describe(result)
    assert "`model.optimizer.backend=megatron` needs CUDA workers" in result.stderr
    assert "`model.optimizer.backend=auto`" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs" / "sft" / "trial0").exists()
