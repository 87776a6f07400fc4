"""ppo-math with a LoRA actor (`actor.lora.rank`) through the real CLI.

- a run trains, writes the actor's adapter in PEFT's format (PEFT on the HF base model gives
  the logits realrl gives) and, with `actor.lora.save_merged`, merged weights that plain
  transformers loads; its optimizer state is the adapter's; a resume from it goes on;
- what realrl does not run with adapters is refused at `--dry-run`, naming key and fix;
- (slow) the LoRA actor learns the built-in task: the task reward rises.
"""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import describe, read_metrics, run_cli

from realrl.api.lora import LoRAConfig
from realrl.models.checkpoint import load_pretrained
from realrl.models.lora import add_adapters
from realrl.models.peft_format import load_adapter
from realrl.workers.realloc import moving_parameter_shapes

LORA_RUN = ["actor.lora.rank=4", "actor.optimizer.lr=1e-3", "dataset.batch_size=4",
            "group_size=2", "gen.max_new_tokens=8", "n_devices_per_node=2"]
ADAPTER_TENSORS = 4 * 7 * 2  # the default model's layers x projections x (A, B)


def logits(model, sequence: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(sequence, torch.tensor([0, sequence.numel()], dtype=torch.int32))


@pytest.mark.slow  # two runs of the CLI
def test_lora_actor_trains_saves_peft_and_merged_weights_and_resumes(tiny_model, cli_env, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    overrides = [f"actor.path={tiny_model}", f"output_root={tmp_path}", *LORA_RUN,
                 "actor.lora.save_merged=true", "total_train_steps=2"]
    result = run_cli("ppo-math", overrides, cli_env)
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "ppo-math" / "trial0"
    actor_dir = run_dir / "checkpoints" / "step000002" / "actor"
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= {
        p.name for p in actor_dir.iterdir()}
    assert not (actor_dir / "model.safetensors").exists()  # no full copy beside the adapter
    assert not (run_dir / "checkpoints" / "step000002" / "ref").exists()  # ref never changes
    optimizer = torch.load(actor_dir / "optimizer.pt", weights_only=False)["optimizer"]
    assert len(optimizer["state"]) == ADAPTER_TENSORS

    # realrl's adapted actor, PEFT's on the HF base, and the merged HF model agree.
    lora = LoRAConfig(rank=4)
    ours = add_adapters(load_pretrained(tiny_model), lora, seed=0)
    adapter = load_adapter(actor_dir, lora, dict(moving_parameter_shapes(ours)), torch.float32,
                           "cpu")
    assert any(t.abs().max() > 0 for n, t in adapter.items() if ".lora_B." in n)  # it trained
    ours.load_state_dict(adapter, strict=False)
    sequence = torch.randint(0, ours.config.vocab_size, (12,),
                             generator=torch.Generator().manual_seed(0))
    expected = logits(ours, sequence)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    with torch.no_grad():
        with_peft = peft.PeftModel.from_pretrained(base, str(actor_dir)).eval()
        torch.testing.assert_close(with_peft(sequence[None]).logits[0], expected,
                                   rtol=0, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(actor_dir / "merged",
                                                      torch_dtype=torch.float32).eval()
        torch.testing.assert_close(merged(sequence[None]).logits[0], expected, rtol=0, atol=1e-5)

    resumed = run_cli("ppo-math", [*overrides, "total_train_steps=3", "recover_mode=resume"],
                      cli_env)
    assert resumed.returncode == 0, describe(resumed)
    assert [m["step"] for m in read_metrics(run_dir)][-1] == 3
    assert "resumed from" in (run_dir / "logs" / "master.log").read_text()
    assert f"loaded the LoRA adapter of actor from {actor_dir}" in (
        run_dir / "logs" / "worker0.log").read_text()


def _error(result) -> str:
    assert result.returncode == 2, describe(result)
    assert "Traceback" not in result.stdout + result.stderr, describe(result)
    return result.stderr


def test_dry_run_refuses_what_lora_cannot_run(tiny_model, cli_env, tmp_path):
    common = [f"actor.path={tiny_model}", f"output_root={tmp_path}", "--dry-run",
              "n_devices_per_node=2", "actor.lora.rank=8"]
    keys = _error(run_cli("ppo-math", [
        *common, "actor.compile=true", "ref.lora.rank=4", "ref.offload=true",
        "actor.lora.dropout=0.1", "actor.gradient_checkpointing=true",
        "actor.lora.target_modules=[q_proj,qkv]"], cli_env))
    for expected in ("`actor.compile=true`", "`ref.lora.rank=4`", "`ref.offload=true`",
                     "`actor.lora.dropout=0.1` with `actor.gradient_checkpointing=true`",
                     "`actor.lora.target_modules` names ['qkv']"):
        assert expected in keys, keys
    layouts = _error(run_cli("ppo-math", [
        *common, "actor.lora.dropout=0.1",
        "allocation_mode=actor_gen:d1@0,actor_train:d1t2,ref_inf:d1@1,*:d2"], cli_env))
    assert "`actor.lora.dropout=0.1` with tensor parallelism (actor_train:d1t2p1)" in layouts
    assert "rank(s) [1] hold none" in layouts and "MFC `ref_inf`" in layouts


@pytest.mark.slow
def test_ppo_with_a_lora_actor_raises_the_task_reward(cli_env, tmp_path):
    # The built-in defaults (SFT warm-started actor, built-in task) with a rank-8 adapter
    # instead of full fine-tuning, GRPO for speed; the reference is the adapter-free base.
    result = run_cli("ppo-math", [
        f"output_root={tmp_path}", "n_devices_per_node=2", "actor.lora.rank=8",
        "actor.optimizer.lr=1e-3", "ppo.disable_value=true", "ppo.adv_estimator=grpo",
        "total_train_steps=100", "share_idle_cores=false"], cli_env, timeout_s=900)
    assert result.returncode == 0, describe(result)
    rewards = [m["reward/task_mean"] for m in read_metrics(tmp_path / "ppo-math" / "trial0")]
    fifth = len(rewards) // 5
    first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
    assert last - first >= 0.05, (first, last, rewards)
