"""LoRA adapters on one device: the math, PEFT's format, the reference view and the optimizer.

- an adapted model computes what its merged weights compute (forward, generation);
- its adapter saved in PEFT's format loads with `peft.PeftModel.from_pretrained` on the
  Hugging Face base model and gives the same logits within 1e-5 (a language model and a
  critic);
- a base view is the base model without the adapter, on the same tensors;
- an engine on an adapted model gives gradients and AdamW state to the adapters only.
"""

from __future__ import annotations

import pytest
import torch
from tiny_hf_models import hf_logits_per_sequence, random_packed_batch, save_hf

from realrl.api.lora import LoRAConfig
from realrl.backends.torch_engine import ParallelContext, TorchEngine
from realrl.models.checkpoint import load_pretrained
from realrl.models.config import ModelConfig
from realrl.models.generation import generate
from realrl.models.lora import add_adapters, base_view, merged_state_dict, trained_parameter_names
from realrl.models.peft_format import load_adapter, realrl_name, save_adapter
from realrl.models.sampling import GenerationConfig
from realrl.models.transformer import Transformer
from realrl.workers.realloc import moving_parameter_shapes

TOLERANCE = 1e-5
CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, qkv_bias=True,
                     model_type="qwen2")
SOME_TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def trained_adapter(model: Transformer, seed: int = 0) -> Transformer:
    """`model` with its adapters' B factors moved off zero (a trained adapter)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    return model


def adapted(lora: LoRAConfig, config: ModelConfig = CONFIG) -> Transformer:
    torch.manual_seed(0)
    return trained_adapter(add_adapters(Transformer(config), lora, seed=1))


def batch():
    ids = torch.randint(0, CONFIG.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
    return ids, torch.tensor([0, 5, 12], dtype=torch.int32)


def test_adapted_model_computes_what_its_merged_weights_compute():
    lora = LoRAConfig(rank=4, alpha=6, target_modules=SOME_TARGETS)
    model = adapted(lora)
    merged = Transformer(CONFIG)
    merged.load_state_dict(merged_state_dict(model.state_dict(), CONFIG, lora))
    ids, cu_seqlens = batch()
    with torch.no_grad():
        assert (model(ids, cu_seqlens) - merged(ids, cu_seqlens)).abs().max() <= TOLERANCE
    # Generation's CPU decode step (features first) adds the adapters too.
    outputs = [generate(m, ids[:5], cu_seqlens[:2], GenerationConfig(max_new_tokens=6, greedy=True),
                        torch.Generator().manual_seed(0)) for m in (model, merged)]
    assert torch.equal(outputs[0].packed_input_ids, outputs[1].packed_input_ids)
    assert (outputs[0].packed_logprobs - outputs[1].packed_logprobs).abs().max() <= TOLERANCE


def test_a_fresh_adapter_leaves_the_model_unchanged_and_freezes_the_base():
    torch.manual_seed(0)
    base = Transformer(CONFIG)
    ids, cu_seqlens = batch()
    with torch.no_grad():
        expected = base(ids, cu_seqlens)
    model = add_adapters(base, LoRAConfig(rank=4), seed=1)  # B = 0
    with torch.no_grad():
        assert torch.equal(model(ids, cu_seqlens), expected)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(trained_parameter_names(model))
    # 2 layers x (q, k, v, o, gate, up, down) x (A, B)
    assert len(trainable) == 2 * 7 * 2 and all(".lora_" in name for name in trainable)


def test_adapter_initialisation_depends_on_the_seed_and_name_only():
    first = add_adapters(Transformer(CONFIG), LoRAConfig(rank=4), seed=5).state_dict()
    second = add_adapters(Transformer(CONFIG), LoRAConfig(rank=4), seed=5).state_dict()
    other = add_adapters(Transformer(CONFIG), LoRAConfig(rank=4), seed=6).state_dict()
    name = "layers.1.mlp.gate_up_lora.lora_A.up_proj"
    assert torch.equal(first[name], second[name]) and not torch.equal(first[name], other[name])
    assert first[name].abs().max() <= CONFIG.hidden_size ** -0.5  # PEFT's Kaiming bound


def test_peft_loads_the_saved_adapter_with_the_same_logits(tmp_path):
    peft = pytest.importorskip("peft")
    hf_model = save_hf(tmp_path / "base", "qwen2")
    model = load_pretrained(tmp_path / "base")
    lora = LoRAConfig(rank=4, alpha=8)
    trained_adapter(add_adapters(model, lora, seed=3))
    parameters = dict(model.named_parameters())
    save_adapter(tmp_path / "adapter", {n: parameters[n] for n in trained_parameter_names(model)},
                 lora, str(tmp_path / "base"), critic=False)
    sequences, packed, cu_seqlens = random_packed_batch([7, 11], hf_model.config.vocab_size)
    with torch.no_grad():
        ours = model(packed, cu_seqlens)
    peft_model = peft.PeftModel.from_pretrained(hf_model, str(tmp_path / "adapter")).eval()
    assert (hf_logits_per_sequence(peft_model, sequences) - ours).abs().max() <= TOLERANCE
    with peft_model.disable_adapter():  # the adapter matters: without it the logits differ
        assert (hf_logits_per_sequence(peft_model, sequences) - ours).abs().max() > 0.01
    # And back: realrl reads what it wrote, under its own names.
    shapes = dict(moving_parameter_shapes(model))
    loaded = load_adapter(tmp_path / "adapter", lora, shapes, torch.float32, "cpu")
    assert all(torch.equal(loaded[name], parameters[name]) for name in shapes)


def test_peft_loads_a_critic_adapter_with_its_value_head(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForSequenceClassification

    save_hf(tmp_path / "base", "qwen2")
    critic = load_pretrained(tmp_path / "base", critic=True)
    lora = LoRAConfig(rank=4, target_modules=SOME_TARGETS)
    trained_adapter(add_adapters(critic, lora, seed=3))
    assert critic.value_head.weight.requires_grad
    with torch.no_grad():
        critic.value_head.weight.normal_()
    parameters = dict(critic.named_parameters())
    save_adapter(tmp_path / "adapter", {n: parameters[n] for n in trained_parameter_names(critic)},
                 lora, str(tmp_path / "base"), critic=True)
    hf_critic = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=1)
    hf_critic.config.pad_token_id = 0
    peft_model = peft.PeftModel.from_pretrained(hf_critic, str(tmp_path / "adapter")).eval()
    sequences, packed, cu_seqlens = random_packed_batch([7, 11], critic.config.vocab_size)
    with torch.no_grad():
        values = critic(packed, cu_seqlens)  # [total_tokens]
        scores = torch.cat([peft_model(s[None]).logits[0] for s in sequences])  # last tokens
    last_tokens = cu_seqlens[1:] - 1
    assert (values[last_tokens] - scores).abs().max() <= TOLERANCE


def test_realrl_and_peft_names_map_one_to_one():
    model = add_adapters(Transformer(CONFIG, ), LoRAConfig(rank=2), seed=0)
    from realrl.models.peft_format import peft_name

    for name in trained_parameter_names(model):
        assert realrl_name(peft_name(name)) == name
    assert peft_name("layers.1.attention.qkv_lora.lora_B.k_proj") == (
        "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight")


def test_base_view_is_the_base_model_on_the_same_tensors():
    lora = LoRAConfig(rank=4)
    model = adapted(lora)
    view = base_view(model, None, seed=1)
    base = Transformer(CONFIG)
    base.load_state_dict({n: t for n, t in model.state_dict().items() if "_lora." not in n})
    ids, cu_seqlens = batch()
    with torch.no_grad():
        assert torch.equal(view(ids, cu_seqlens), base(ids, cu_seqlens))
        assert not torch.equal(model(ids, cu_seqlens), base(ids, cu_seqlens))
    # Parameters held: the view adds nothing; the adapted model's are base + adapters.
    storages = {p.data_ptr() for p in model.parameters()}
    assert {p.data_ptr() for p in view.parameters()} <= storages
    assert sum(p.numel() for p in view.parameters()) == sum(p.numel() for p in base.parameters())
    assert model.layers[0].attention.qkv_lora is not None  # the donor keeps its adapters
    assert all(p.requires_grad for n, p in model.named_parameters() if "_lora." in n)
    # A view with an adapter of its own (an EMA reference) starts as the base.
    own = base_view(model, lora, seed=1)
    with torch.no_grad():
        assert (own(ids, cu_seqlens) - base(ids, cu_seqlens)).abs().max() == 0
    assert {p.data_ptr() for n, p in own.named_parameters() if "_lora." not in n} <= storages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_the_adapters_get_gradients_and_optimizer_state(dtype):
    torch.manual_seed(0)
    module = add_adapters(Transformer(CONFIG).to(dtype), LoRAConfig(rank=4), seed=1)
    engine = TorchEngine(module, None, ParallelContext(), optimizer_config=_optimizer())
    base_before = {n: p.detach().clone() for n, p in module.named_parameters() if "_lora." not in n}
    adapters_before = {n: p.detach().clone() for n, p in module.named_parameters()
                       if "_lora." in n}
    ids, cu_seqlens = batch()

    def loss_fn(forward, microbatch):
        hidden = forward(ids, cu_seqlens)
        return -module.shifted_logprobs(hidden, ids, cu_seqlens).float().sum(), {}

    engine.train_microbatches([None], loss_fn)
    adapters = len(adapters_before)
    # AdamW state: one entry (step, exp_avg, exp_avg_sq) per adapter parameter, none for the base.
    assert len(engine.optimizer.state) == adapters == 2 * 7 * 2
    state_values = sum(v.numel() for s in engine.optimizer.state.values()
                       for k, v in s.items() if k != "step")
    assert state_values == 2 * sum(t.numel() for t in adapters_before.values())
    if dtype == torch.bfloat16:  # fp32 masters of the adapters only
        masters = engine.backend.master_weights.masters
        assert sum(m.numel() for m in masters) == sum(t.numel() for t in adapters_before.values())
    parameters = dict(module.named_parameters())
    assert all(torch.equal(parameters[n], t) for n, t in base_before.items())
    assert all(parameters[n].grad is None for n in base_before)
    moved = [n for n, t in adapters_before.items() if not torch.equal(parameters[n], t)]
    assert any(".lora_B." in n for n in moved)  # B leaves zero after the first step


def _optimizer():
    from realrl.api.experiment import OptimizerConfig

    return OptimizerConfig(lr=1e-2)
