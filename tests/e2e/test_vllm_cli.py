"""`ppo-math gen.backend=vllm` through the real CLI on CPU workers, with vLLM's CPU build
(skipped without it: `bash benchmarks/vllm_check.sh cpu` installs it and runs this file).

Both workers generate with a vLLM engine each, colocated in the worker, and the actor's new
weights reach the engines after every train step (reallocation into the generation layout,
then a push into each engine). With one optimizer step a batch, the trainer's log-probs of the
batch before its update are those of the weights that generated it, so the PPO ratio's
`approx_kl` between them is zero to rounding at every step, not only the first: one step of
stale weights in an engine shows as ~5e-3 here (the defect this test was written for: the
replica that shares its peer's copy of the weights saw no change, and pushed nothing). The run
stops after 2 steps with a checkpoint and a second run resumes it: the checkpoint is the tied HF
checkpoint the actor came as (vLLM's CPU build runs an untied copy), and the resumed engines
sample the loaded weights.
"""

from __future__ import annotations

import pytest
from e2e_helpers import (
    checkpoint_weights,
    describe,
    processes_mentioning,
    read_metrics,
    run_cli,
)

from realrl.api.vllm_build import installed_vllm_build

pytestmark = pytest.mark.skipif(installed_vllm_build() != "cpu",
                                reason="needs vLLM's CPU build (benchmarks/vllm_check.sh cpu)")
SAVED, STEPS = 2, 4


def test_ppo_math_trains_on_vllm_samples_of_the_current_weights_every_step(cli_env, tmp_path):
    def run(steps, *extra):
        result = run_cli("ppo-math", [f"output_root={tmp_path}", f"total_train_steps={steps}",
                                      f"save_freq_steps={SAVED}", "gen.backend=vllm",
                                      "gen.vllm_gpu_memory_utilization=0.1",
                                      "ppo.num_minibatches=1", "ppo.num_epochs=1", *extra],
                         cli_env, timeout_s=600)  # two engines start on 2 cores: ~2.5 minutes
        assert result.returncode == 0, describe(result)
        # The engines stopped, not killed (killed, their shared memory is reported leaked).
        assert "leaked shared_memory" not in result.stdout + result.stderr, describe(result)
        # Workers and their engines all gone (vLLM names its processes VLLM::EngineCore, ...).
        assert processes_mentioning(str(tmp_path)) == {} and processes_mentioning("VLLM::") == {}
        return result

    run_dir = tmp_path / "ppo-math" / "trial0"
    run(SAVED)
    saved = checkpoint_weights(run_dir, SAVED, "actor")
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
    run(STEPS, "recover_mode=auto")
    master_log = (run_dir / "logs" / "master.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / f'step{SAVED:06d}'}" in master_log
    metrics = read_metrics(run_dir)
    assert [step["step"] for step in metrics] == list(range(1, STEPS + 1))
    for step in metrics:
        assert abs(step["actor_train/approx_kl"]) < 1e-6, step["step"]
        assert abs(step["actor_train/importance_ratio"] - 1) < 1e-5, step["step"]
    first = metrics[0]  # the actor is the reference: the engines sample the reference's model
    assert abs(first["actor_train/kl_to_ref"]) < 1e-6 and first["actor_train/clip_fraction"] == 0
    assert first["reward/task_mean"] > 0.2  # the packaged warm-started actor, not noise
