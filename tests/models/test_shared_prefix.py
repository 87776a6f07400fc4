"""Shared prefixes: the compact rows of a packed batch, and a forward that is unchanged by them."""

from __future__ import annotations

import pytest
import torch
from tiny_hf_models import hf_logits_per_sequence, save_hf

from realrl.models.attention import PackedLayout
from realrl.models.checkpoint import load_pretrained
from realrl.models.compiled import enable_compiled_blocks
from realrl.models.shared_prefix import find_shared_prefixes


def packed(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.tensor([len(s) for s in sequences]).cumsum(0)
    return torch.tensor([t for s in sequences for t in s]), cu_seqlens


def shared_prefixes(sequences, position_ids=None, min_shared_fraction=0.05):
    ids, cu_seqlens = packed(sequences)
    layout = PackedLayout.from_cu_seqlens(cu_seqlens)
    if position_ids is None:
        layout.ensure_token_indices()
        position_ids = layout.index_in_sequence
    return find_shared_prefixes(ids, position_ids, layout, min_shared_fraction)


def test_tokens_shared_along_a_chain_of_sequences_map_to_the_first_owner():
    # Packed positions: A 0-3, B 4-6, C 7-10, D 11-12. B shares 5, 6 with A; C shares 5, 6, 9
    # with B (so 5, 6 with A); D shares nothing. Owned tokens in packed order: A's four, B's 9,
    # C's 4, D's two.
    prefixes = shared_prefixes([[5, 6, 7, 8], [5, 6, 9], [5, 6, 9, 4], [3, 3]])
    assert prefixes.owner_index.tolist() == [0, 1, 2, 3, 6, 10, 11, 12]
    assert prefixes.compact_index.tolist() == [0, 1, 2, 3, 0, 1, 4, 0, 1, 4, 5, 6, 7]
    assert prefixes.num_compact == 8


def test_identical_sequences_are_computed_once():
    prefixes = shared_prefixes([[1, 2, 3]] * 3)
    assert prefixes.owner_index.tolist() == [0, 1, 2]
    assert prefixes.compact_index.tolist() == [0, 1, 2] * 3


def test_nothing_is_shared_across_different_positions_or_below_the_threshold():
    same_tokens = [[4, 5], [4, 5]]
    assert shared_prefixes(same_tokens, position_ids=torch.tensor([0, 1, 1, 2])) is None
    assert shared_prefixes([[4, 5, 6, 7], [4, 1, 2, 3]], min_shared_fraction=0.2) is None
    assert shared_prefixes([[4, 5, 6, 7], [4, 1, 2, 3]], min_shared_fraction=0.1) is not None
    assert shared_prefixes([[4, 5, 6, 7]]) is None


# Groups of four responses to one prompt, packed the way `actor_train` sees a GRPO batch, with
# uneven response lengths, responses that begin alike and two identical responses.
PROMPTS = [[7, 3, 9, 1, 4], [2, 8, 8], [5]]
RESPONSES = [
    [[10, 11, 12], [10, 11, 30, 31, 32], [40], [10, 11, 12]],
    [[50, 51], [52, 53, 54, 55], [50, 51, 56], [60]],
    [[61, 62, 63, 64, 65, 66], [61], [70, 71], [72, 73, 74]],
]
GROUPED = [prompt + response for prompt, group in zip(PROMPTS, RESPONSES) for response in group]


def forward_and_gradients(model, sequences, share: bool):
    ids, cu_seqlens = packed(sequences)
    model.share_prefixes = share
    model.zero_grad()
    output = model(ids, cu_seqlens)
    weights = torch.linspace(-1.0, 1.0, output.numel()).view_as(output)
    (output.float() * weights).sum().backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
    return output.detach(), gradients


def assert_same_forward_and_gradients(model, sequences, tolerance: float):
    plain, plain_gradients = forward_and_gradients(model, sequences, share=False)
    shared, shared_gradients = forward_and_gradients(model, sequences, share=True)
    assert (plain - shared).abs().max() <= tolerance
    for name, gradient in plain_gradients.items():
        scale = gradient.abs().max().clamp_min(1.0)
        assert (gradient - shared_gradients[name]).abs().max() <= tolerance * scale, name


@pytest.mark.parametrize("kernel", ["auto", "padded", "bucketed", "per_sequence", "block_diagonal"])
@pytest.mark.parametrize("family", [("qwen2", {}), ("mistral", {"sliding_window": 4})])
def test_sharing_prefixes_leaves_logits_and_gradients_unchanged(tmp_path, kernel, family):
    model_type, overrides = family
    save_hf(tmp_path, model_type, **overrides)
    model = load_pretrained(tmp_path)
    model.attention_kernel = kernel
    assert_same_forward_and_gradients(model, GROUPED, tolerance=1e-5)


def test_a_shared_prefix_forward_matches_transformers_per_sequence(tmp_path):
    hf_model = save_hf(tmp_path, "llama")
    model = load_pretrained(tmp_path)
    ids, cu_seqlens = packed(GROUPED)
    prefixes = shared_prefixes(GROUPED)
    assert prefixes.num_compact < 0.75 * ids.numel()  # the test does exercise sharing
    with torch.no_grad():
        logits = model(ids, cu_seqlens)
    expected = hf_logits_per_sequence(hf_model, [torch.tensor(s) for s in GROUPED])
    assert (logits - expected).abs().max() <= 1e-5


def test_a_critic_shares_prefixes_in_its_values_and_gradients(tmp_path):
    save_hf(tmp_path, "qwen2")
    critic = load_pretrained(tmp_path, critic=True)
    with torch.no_grad():  # a fresh value head is zero: give it weights so values mean something
        critic.value_head.weight.normal_()
    assert_same_forward_and_gradients(critic, GROUPED, tolerance=1e-5)


def test_compiled_blocks_share_prefixes(tmp_path):
    save_hf(tmp_path, "qwen2")
    model = load_pretrained(tmp_path)
    enable_compiled_blocks(model, "actor.compile")
    assert_same_forward_and_gradients(model, GROUPED, tolerance=1e-5)
