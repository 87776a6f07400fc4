"""Tokens that consecutive packed sequences share from their start run through the model once.

A GRPO batch packs every prompt `group_size` times (once per sampled response), and a DPO or
reward-model pair packs its prompt twice. A causal model's hidden state at a token depends only
on the tokens up to it and their positions, so when sequence s begins with the same tokens at
the same positions as sequence s - 1, those tokens have the same hidden states in every layer of
both. The packed forward (`Transformer.forward` with `share_prefixes`) therefore runs the
norms, projections and MLPs on *compact* rows, each shared token once, and only attention sees
every sequence whole: queries, keys and values are gathered back to the packed layout, the
usual varlen kernel runs, and one output row per compact row is kept. The final hidden states
are gathered to the packed layout before the head, so logits (or values) come out for every
packed token exactly as without sharing, up to float rounding, and autograd sums the gradient
of a shared row over every sequence that reads it.

Sharing follows chains: token i of sequence s maps to token i of s - 1 when the two sequences
agree on tokens 0..i, which maps on to s - 2, and so on. A group's responses that begin with
the same tokens share those too.

What it saves: the matmul and element-wise work of the shared tokens, i.e. (n - 1) / n of the
prompt's share of a group of n sequences (attention still costs what it did). Measured in
`benchmarks/README.md` ("Sixth performance pass").
"""

from __future__ import annotations

import dataclasses

import torch

from realrl.models.attention import PackedLayout

# Below this share of shared tokens, the gathers around every attention call cost more than the
# rows they save.
MIN_SHARED_FRACTION = 0.05


@dataclasses.dataclass
class SharedPrefixes:
    """How the packed tokens map onto compact rows."""

    compact_index: torch.Tensor  # [total_tokens] long: the compact row holding each token's state
    owner_index: torch.Tensor  # [compact_tokens] long: the packed token each compact row computes

    @property
    def num_compact(self) -> int:
        return self.owner_index.shape[0]

    def compact(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed rows [total_tokens, ...] -> compact rows [compact_tokens, ...]."""
        return packed.index_select(0, self.owner_index)

    def expand(self, compact: torch.Tensor) -> torch.Tensor:
        """Compact rows [compact_tokens, ...] -> packed rows [total_tokens, ...]."""
        return compact.index_select(0, self.compact_index)


def find_shared_prefixes(
    packed_input_ids: torch.Tensor,  # [total_tokens]
    position_ids: torch.Tensor,  # [total_tokens]
    layout: PackedLayout,
    min_shared_fraction: float = MIN_SHARED_FRACTION,
) -> SharedPrefixes | None:
    """The compact rows of a packed batch, or None when fewer than `min_shared_fraction` of its
    tokens are shared with the sequence before them (one host sync)."""
    num_seqs, max_len = len(layout.seq_lens), layout.max_seqlen
    total_tokens = packed_input_ids.shape[0]
    if num_seqs < 2:
        return None
    device = packed_input_ids.device
    layout.ensure_token_indices()
    rows, cols = layout.sequence_index, layout.index_in_sequence
    valid = torch.zeros(num_seqs, max_len, dtype=torch.bool, device=device)
    valid[rows, cols] = True
    ids = torch.full((num_seqs, max_len), -1, dtype=packed_input_ids.dtype, device=device)
    ids[rows, cols] = packed_input_ids
    positions = torch.full((num_seqs, max_len), -1, dtype=position_ids.dtype, device=device)
    positions[rows, cols] = position_ids
    # Token i of sequence s is shared when s and s - 1 agree (ids and positions) on 0..i.
    agree = (ids[1:] == ids[:-1]) & (positions[1:] == positions[:-1]) & valid[1:] & valid[:-1]
    shared = torch.zeros_like(valid)
    shared[1:] = agree.int().cumprod(1).bool()
    if int(shared.sum()) < min_shared_fraction * total_tokens:
        return None
    owned = valid & ~shared
    # A shared token's state lives in the nearest earlier sequence that owns that column: the
    # chain s, s - 1, ... is shared down to it.
    sequence = torch.arange(num_seqs, device=device)[:, None].expand(num_seqs, max_len)
    owner_sequence = torch.where(owned, sequence, -1).cummax(0).values.clamp_min(0)
    compact_rows = owned.flatten().long().cumsum(0).view(num_seqs, max_len) - 1
    compact_index = compact_rows.gather(0, owner_sequence)[rows, cols]
    starts = layout.cu_seqlens[:-1].long()[:, None]
    packed_position = starts + torch.arange(max_len, device=device)[None, :]
    return SharedPrefixes(compact_index=compact_index, owner_index=packed_position[owned])
