"""The EMA reference update into a bf16 reference (`realloc._blend`, `TorchEngine.ema_master`).

`ref = eta * actor + (1 - eta) * ref` moves each weight by `eta * (actor - ref)`: with the small
etas EMA references use and an actor a few optimizer steps away, that is far below half a bf16
spacing, so blending into the bf16 weights themselves rounds every update away and the
reference never moves. A bf16 EMA target blends into fp32 masters and takes them rounded.
"""

from __future__ import annotations

import torch

from realrl.backends.torch_engine import ParallelContext, TorchEngine
from realrl.models.config import ModelConfig
from realrl.models.transformer import Transformer
from realrl.workers import realloc

ETA, STEPS = 0.05, 40


def bf16_engine(seed: int) -> TorchEngine:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, model_type="qwen2", eos_token_id=1,
    ))
    return TorchEngine(model.to(torch.bfloat16), None, ParallelContext())  # frozen


def actor_near(reference: TorchEngine) -> dict[str, torch.Tensor]:
    """bf16 actor weights some training away: each differs from the reference by ~1% of its
    magnitude (one to three bf16 spacings, |w| x 2^-8 to 2^-7), so that one EMA step moves a
    weight by ~0.05% of its magnitude, below half a spacing."""
    generator = torch.Generator().manual_seed(3)
    return {
        name: (p.float() * (1 + 1e-2 * torch.randn(p.shape, generator=generator)))
        .to(torch.bfloat16)
        for name, p in reference.module.named_parameters()
    }


def blend_steps(reference: TorchEngine, actor: dict[str, torch.Tensor]) -> None:
    parameters = dict(reference.module.named_parameters())
    for _ in range(STEPS):
        for name, source in actor.items():
            realloc._blend(reference, name, parameters[name], source, ETA)


def test_ema_into_a_bf16_reference_follows_the_fp32_formula():
    reference = bf16_engine(seed=0)
    start = {name: p.float() for name, p in reference.module.named_parameters()}
    actor = actor_near(reference)
    blend_steps(reference, actor)
    keep = (1 - ETA) ** STEPS  # r_n = a + (1 - eta)^n (r_0 - a)
    changed = total = 0
    for name, parameter in reference.module.named_parameters():
        expected = actor[name].float() + keep * (start[name] - actor[name].float())
        master = reference.ema_masters[name]
        torch.testing.assert_close(master, expected, rtol=1e-5, atol=1e-7)
        assert torch.equal(parameter, master.to(torch.bfloat16)), name  # rounded to nearest
        changed += int((parameter.float() != start[name]).sum())
        total += parameter.numel()
    # 1 - 0.95^40 = 87% of the way to the actor: most weights cross a bf16 rounding boundary
    # (blending in bf16 itself left every one of them where it was).
    assert changed / total > 0.5


def test_ema_masters_survive_a_checkpoint_and_reset_when_weights_are_loaded():
    reference = bf16_engine(seed=0)
    blend_steps(reference, actor_near(reference))
    state = reference.state_for_checkpoint()
    assert set(state) == {"ema_masters"}
    resumed = bf16_engine(seed=1)  # other weights: the checkpoint replaces them
    resumed.load_checkpoint_state(state)
    for name, parameter in resumed.module.named_parameters():
        assert torch.equal(resumed.ema_masters[name], reference.ema_masters[name])
        assert torch.equal(parameter, dict(reference.module.named_parameters())[name])
    resumed.weights_written()  # weights loaded from elsewhere: the masters follow them
    assert resumed.ema_masters == {}


def test_fp32_and_trained_engines_blend_without_masters():
    model = Transformer(ModelConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, model_type="qwen2", eos_token_id=1,
    ))
    frozen_fp32 = TorchEngine(model, None, ParallelContext())
    name = next(iter(dict(model.named_parameters())))
    assert frozen_fp32.ema_master(name) is None
    assert frozen_fp32.state_for_checkpoint() == {}
