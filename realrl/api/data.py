"""`SequenceSample`: the packed batch that flows along every edge of the dataflow graph.

Every data key holds ONE tensor that concatenates the sequences of all samples, plus the
per-sample sequence lengths needed to cut it apart again. Nothing is padded.

Notation used in shape comments throughout realrl:

- ``bs``: number of samples in the batch. A sample is the unit that is never split: one
  prompt, or one prompt together with the group of responses generated for it.
- ``seqlens[key][i]``: the list of sequence lengths that sample ``i`` holds for ``key``.
  A prompt is ``[17]``; a group of 4 responses is ``[30, 12, 41, 9]``; a per-sample scalar
  (a reward, a prompt length) is ``[1]``.
- ``num_seqs``: number of sequences of a key over the whole batch (sum of ``len(seqlens[key][i])``).
- ``total_tokens``: sum of all sequence lengths of a key; dim 0 of its packed tensor.
- ``trailing_shape``: the per-token shape after dim 0, e.g. ``()`` for token ids,
  ``(vocab_size,)`` for logits.
- ``cu_seqlens``: ``[num_seqs + 1]`` int32 prefix sums of the flattened lengths, starting at 0,
  in the layout flash-attention style kernels expect.

So ``data["packed_input_ids"]`` has shape ``[total_tokens]`` and ``data["rewards"]`` (one scalar
per sample) has shape ``[bs]``.

Token counting for balancing (``split_microbatches``, ``split_data_parallel``): with a
``token_key`` a sample weighs the sum of its lengths for that key; by default it weighs the
largest such sum over all of its keys, i.e. the longest packed key it carries (usually
``packed_input_ids``), which is what bounds activation memory in a forward pass.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import json
import logging
import math
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)


def balanced_partition(
    weights: list[int], min_parts: int, max_weight_per_part: int | None
) -> list[list[int]]:
    """Partition item indices into the fewest parts (>= ``min_parts``) under a weight budget.

    For a candidate part count, items go heaviest first to the currently lightest part
    (longest-processing-time greedy, within 4/3 of the optimal maximum). An item heavier than
    the budget may only open an empty part. If an item does not fit, one more part is tried;
    with one part per item it always fits. Every part is non-empty when
    ``min_parts <= len(weights)``. Parts keep their items in index order and are ordered by
    their first index, so the output is deterministic.
    """
    num_items = len(weights)
    num_parts = max(1, min_parts)
    if max_weight_per_part is not None:
        num_parts = max(num_parts, math.ceil(sum(weights) / max_weight_per_part))
    num_parts = min(num_parts, max(num_items, 1))
    order = sorted(range(num_items), key=lambda i: (-weights[i], i))
    while True:
        groups = _greedy_assign(weights, order, num_parts, max_weight_per_part)
        if groups is not None:
            groups = [sorted(group) for group in groups if group]
            return sorted(groups, key=lambda group: group[0])
        num_parts += 1


def _greedy_assign(
    weights: list[int], order: list[int], num_parts: int, budget: int | None
) -> list[list[int]] | None:
    heap = [(0, 0, part) for part in range(num_parts)]  # (load, num_items, part index)
    groups: list[list[int]] = [[] for _ in range(num_parts)]
    for item in order:
        load, count, part = heapq.heappop(heap)
        if count > 0 and budget is not None and load + weights[item] > budget:
            return None
        groups[part].append(item)
        heapq.heappush(heap, (load + weights[item], count + 1, part))
    return groups


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype name {name!r} in wire header (e.g. 'float32')")
    return dtype


@dataclasses.dataclass(eq=False)
class SequenceSample:
    """A batch of ``bs`` samples, each key stored as one packed tensor (see module docstring)."""

    keys: set[str]
    ids: list[str | int]
    seqlens: dict[str, list[list[int]]]
    trailing_shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    data: dict[str, torch.Tensor | None]
    metadata: dict[str, list[Any]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.keys = set(self.keys)
        self.ids = list(self.ids)
        self.seqlens = {k: [[int(n) for n in lens] for lens in v] for k, v in self.seqlens.items()}
        self.trailing_shapes = {
            k: tuple(int(d) for d in s) for k, s in self.trailing_shapes.items()
        }
        self.dtypes = dict(self.dtypes)
        self.data = dict(self.data)  # own dicts: update_ on a copy must not touch the original
        self.metadata = {k: list(v) for k, v in self.metadata.items()}
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        for field_name in ("seqlens", "trailing_shapes", "dtypes", "data"):
            field_keys = set(getattr(self, field_name))
            if field_keys != self.keys:
                raise ValueError(
                    f"SequenceSample.{field_name} has keys {sorted(field_keys)} but keys is "
                    f"{sorted(self.keys)}; every key needs seqlens, trailing_shapes, dtypes and "
                    "data entries (data may be None)"
                )
        if len(set(self.ids)) != len(self.ids):
            duplicates = sorted(str(i) for i, n in collections.Counter(self.ids).items() if n > 1)
            raise ValueError(
                f"SequenceSample has duplicate sample ids {duplicates}; ids must be unique"
            )
        for key in sorted(self.keys):
            self._validate_key(key)
        for name, values in self.metadata.items():
            if len(values) != self.bs:
                raise ValueError(
                    f"SequenceSample metadata {name!r} has {len(values)} values but the batch has "
                    f"{self.bs} samples; metadata holds exactly one value per sample"
                )

    def _validate_key(self, key: str) -> None:
        lens = self.seqlens[key]
        if len(lens) != self.bs:
            raise ValueError(
                f"SequenceSample key {key!r}: seqlens has {len(lens)} samples but there are "
                f"{self.bs} ids; give one list of lengths per sample"
            )
        if any(n < 0 for sample_lens in lens for n in sample_lens):
            raise ValueError(f"SequenceSample key {key!r}: negative sequence length in {lens}")
        tensor = self.data[key]
        if tensor is None:
            return
        expected_rows = sum(sum(sample_lens) for sample_lens in lens)
        if tensor.dim() == 0 or tensor.shape[0] != expected_rows:
            raise ValueError(
                f"SequenceSample key {key!r}: tensor shape {tuple(tensor.shape)} but seqlens sum "
                f"to {expected_rows} tokens; dim 0 must equal the sum of all sequence lengths"
            )
        if tuple(tensor.shape[1:]) != self.trailing_shapes[key]:
            raise ValueError(
                f"SequenceSample key {key!r}: tensor trailing shape {tuple(tensor.shape[1:])} "
                f"does not match declared trailing_shapes {self.trailing_shapes[key]}"
            )
        if tensor.dtype != self.dtypes[key]:
            raise ValueError(
                f"SequenceSample key {key!r}: tensor dtype {tensor.dtype} does not match "
                f"declared dtype {self.dtypes[key]}"
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_tensors(
        cls,
        ids: list[str | int],
        seqlens: dict[str, list[list[int]]],
        data: dict[str, torch.Tensor | None],
        metadata: dict[str, list[Any]] | None = None,
        trailing_shapes: dict[str, tuple[int, ...]] | None = None,
        dtypes: dict[str, torch.dtype] | None = None,
    ) -> SequenceSample:
        """Build a sample inferring trailing shape and dtype from each tensor.

        ``trailing_shapes``/``dtypes`` are only needed for keys whose data is None.
        """
        trailing_shapes = dict(trailing_shapes or {})
        dtypes = dict(dtypes or {})
        for key, tensor in data.items():
            if tensor is not None:
                trailing_shapes.setdefault(key, tuple(tensor.shape[1:]))
                dtypes.setdefault(key, tensor.dtype)
            elif key not in trailing_shapes or key not in dtypes:
                raise ValueError(
                    f"SequenceSample key {key!r} has no tensor; pass its trailing_shapes and dtypes"
                )
        return cls(set(data), ids, seqlens, trailing_shapes, dtypes, dict(data), metadata or {})

    @classmethod
    def from_default(
        cls,
        ids: list[str | int],
        seqlens: list[int],
        data: dict[str, torch.Tensor],
        metadata: dict[str, list[Any]] | None = None,
        scalar_keys: Iterable[str] = (),
    ) -> SequenceSample:
        """One sequence per sample for every key, with lengths ``seqlens`` (shared by all keys).

        Keys in ``scalar_keys`` instead hold one value per sample: their tensor is ``[bs, ...]``
        and their seqlens become ``[[1]] * bs``.
        """
        scalar_keys = set(scalar_keys)
        unknown = scalar_keys - set(data)
        if unknown:
            raise ValueError(
                f"scalar_keys {sorted(unknown)} are not among data keys {sorted(data)}"
            )
        per_key: dict[str, list[list[int]]] = {}
        for key, tensor in data.items():
            if key in scalar_keys:
                if tensor.shape[0] != len(ids):
                    raise ValueError(
                        f"SequenceSample scalar key {key!r} has {tensor.shape[0]} rows but there "
                        f"are {len(ids)} samples; a scalar key holds exactly one row per sample"
                    )
                per_key[key] = [[1] for _ in ids]
            else:
                per_key[key] = [[int(n)] for n in seqlens]
        return cls.from_tensors(ids, per_key, dict(data), metadata)

    # ------------------------------------------------------------------ sizes
    @property
    def bs(self) -> int:
        return len(self.ids)

    def total_tokens(self, key: str) -> int:
        self._require_keys([key])
        return sum(sum(sample_lens) for sample_lens in self.seqlens[key])

    def seqlens_of(self, key: str) -> list[int]:
        """Flattened sequence lengths of ``key`` over the batch, ``num_seqs`` entries."""
        self._require_keys([key])
        return [n for sample_lens in self.seqlens[key] for n in sample_lens]

    def cu_seqlens(self, key: str) -> torch.Tensor:
        """``[num_seqs + 1]`` int32 prefix sums of ``seqlens_of(key)``, on the key's device."""
        lengths = torch.tensor([0, *self.seqlens_of(key)], dtype=torch.int32)
        tensor = self.data[key]
        device = tensor.device if tensor is not None else "cpu"
        return torch.cumsum(lengths, dim=0, dtype=torch.int32).to(device)

    def sample_token_counts(self, token_key: str | None = None) -> list[int]:
        """Tokens per sample used for balancing (see "Token counting" in the module docstring)."""
        if token_key is not None:
            self._require_keys([token_key])
            return [sum(lens) for lens in self.seqlens[token_key]]
        if not self.keys:
            return [0] * self.bs
        return [max(sum(self.seqlens[k][i]) for k in self.keys) for i in range(self.bs)]

    def _require_keys(self, keys: Iterable[str]) -> None:
        missing = [k for k in keys if k not in self.keys]
        if missing:
            raise KeyError(
                f"SequenceSample has no key(s) {missing}; available keys: {sorted(self.keys)}"
            )

    def _sample_offsets(self, key: str) -> list[int]:
        """``[bs + 1]`` start row of each sample in the packed tensor of ``key``."""
        offsets = [0]
        for sample_lens in self.seqlens[key]:
            offsets.append(offsets[-1] + sum(sample_lens))
        return offsets

    # ------------------------------------------------------------------ batch ops
    @classmethod
    def gather(
        cls, samples: list[SequenceSample], keys: Iterable[str] | None = None
    ) -> SequenceSample:
        """Concatenate samples along the batch. ``keys`` defaults to the first sample's keys."""
        if not samples:
            raise ValueError("SequenceSample.gather needs at least one sample")
        keys = sorted(samples[0].keys if keys is None else set(keys))
        metadata_names = set(samples[0].metadata)
        for index, sample in enumerate(samples):
            missing = [k for k in keys if k not in sample.keys]
            if missing:
                raise ValueError(
                    f"SequenceSample.gather: sample {index} lacks key(s) {missing}; "
                    f"it has {sorted(sample.keys)}"
                )
            if set(sample.metadata) != metadata_names:
                raise ValueError(
                    f"SequenceSample.gather: sample {index} has metadata {sorted(sample.metadata)} "
                    f"but sample 0 has {sorted(metadata_names)}; metadata names must match"
                )
            for key in keys:
                if (sample.trailing_shapes[key], sample.dtypes[key]) != (
                    samples[0].trailing_shapes[key],
                    samples[0].dtypes[key],
                ):
                    raise ValueError(
                        f"SequenceSample.gather: key {key!r} of sample {index} has trailing shape "
                        f"{sample.trailing_shapes[key]} / dtype {sample.dtypes[key]}, sample 0 has "
                        f"{samples[0].trailing_shapes[key]} / {samples[0].dtypes[key]}"
                    )
        data: dict[str, torch.Tensor | None] = {}
        for key in keys:
            tensors = [s.data[key] for s in samples]
            has_tensor = [t is not None for t in tensors]
            if any(has_tensor) and not all(has_tensor):
                raise ValueError(
                    f"SequenceSample.gather: key {key!r} has data in some samples only"
                )
            data[key] = torch.cat(tensors, dim=0) if all(has_tensor) else None  # type: ignore[arg-type]
        return cls(
            keys=set(keys),
            ids=[i for s in samples for i in s.ids],
            seqlens={k: [lens for s in samples for lens in s.seqlens[k]] for k in keys},
            trailing_shapes={k: samples[0].trailing_shapes[k] for k in keys},
            dtypes={k: samples[0].dtypes[k] for k in keys},
            data=data,
            metadata={m: [v for s in samples for v in s.metadata[m]] for m in metadata_names},
        )

    def reorder(self, indices: list[int]) -> SequenceSample:
        """New sample whose i-th sample is ``self``'s ``indices[i]``-th (distinct indices; a subset
        selects samples)."""
        if any(not 0 <= i < self.bs for i in indices) or len(set(indices)) != len(indices):
            raise ValueError(
                f"SequenceSample.reorder: indices must be distinct and in [0, {self.bs}); got {indices}"
            )
        data: dict[str, torch.Tensor | None] = {}
        for key, tensor in self.data.items():
            if tensor is None:
                data[key] = None
                continue
            offsets = self._sample_offsets(key)
            pieces = [tensor[offsets[i] : offsets[i + 1]] for i in indices]
            data[key] = torch.cat(pieces, dim=0) if pieces else tensor[:0]
        return dataclasses.replace(
            self,
            ids=[self.ids[i] for i in indices],
            seqlens={k: [list(v[i]) for i in indices] for k, v in self.seqlens.items()},
            data=data,
            metadata={m: [v[i] for i in indices] for m, v in self.metadata.items()},
        )

    def unpack(self) -> list[SequenceSample]:
        """One single-sample ``SequenceSample`` per sample; tensors are views, not copies."""
        offsets = {key: self._sample_offsets(key) for key in self.keys}
        result = []
        for i in range(self.bs):
            data = {
                k: None if t is None else t[offsets[k][i] : offsets[k][i + 1]]
                for k, t in self.data.items()
            }
            result.append(
                dataclasses.replace(
                    self,
                    ids=[self.ids[i]],
                    seqlens={k: [list(v[i])] for k, v in self.seqlens.items()},
                    data=data,
                    metadata={m: [v[i]] for m, v in self.metadata.items()},
                )
            )
        return result

    def _split_by_groups(
        self, groups: list[list[int]]
    ) -> tuple[list[SequenceSample], list[int], list[int]]:
        forward_indices = [i for group in groups for i in group]
        backward_indices = [0] * len(forward_indices)
        for position, original in enumerate(forward_indices):
            backward_indices[original] = position
        return [self.reorder(group) for group in groups], forward_indices, backward_indices

    def split_microbatches(
        self,
        max_tokens_per_microbatch: int | None,
        min_num_microbatches: int = 1,
        token_key: str | None = None,
    ) -> tuple[list[SequenceSample], list[int], list[int]]:
        """Split into micro-batches of whole samples under a token budget.

        Uses the fewest micro-batches (at least ``min_num_microbatches``, capped at ``bs``) for
        which a longest-processing-time greedy assignment keeps every micro-batch within
        ``max_tokens_per_microbatch``; a sample larger than the budget sits alone. Returns
        ``(microbatches, forward_indices, backward_indices)``: ``forward_indices`` lists the
        original sample indices in the order of the concatenated micro-batches, and
        ``SequenceSample.gather(microbatches).reorder(backward_indices)`` restores ``self``.
        """
        if max_tokens_per_microbatch is not None and max_tokens_per_microbatch <= 0:
            raise ValueError(
                f"max_tokens_per_microbatch must be positive or None, got {max_tokens_per_microbatch}"
            )
        if min_num_microbatches < 1:
            raise ValueError(f"min_num_microbatches must be >= 1, got {min_num_microbatches}")
        if self.bs == 0:
            raise ValueError("cannot split an empty SequenceSample into micro-batches")
        groups = balanced_partition(
            self.sample_token_counts(token_key),
            min_parts=min(min_num_microbatches, self.bs),
            max_weight_per_part=max_tokens_per_microbatch,
        )
        return self._split_by_groups(groups)

    def split_data_parallel(
        self, n: int, token_key: str | None = None
    ) -> tuple[list[SequenceSample], list[int], list[int]]:
        """Split into exactly ``n`` non-empty parts balanced by tokens, one per data-parallel rank.

        Returns ``(parts, forward_indices, backward_indices)`` as ``split_microbatches`` does.
        """
        if n < 1 or self.bs < n:
            raise ValueError(
                f"cannot split a batch of {self.bs} samples over {n} data-parallel ranks; every "
                "rank needs at least one sample: raise the batch size or lower data parallelism"
            )
        groups = balanced_partition(
            self.sample_token_counts(token_key), min_parts=n, max_weight_per_part=None
        )
        return self._split_by_groups(groups)

    # ------------------------------------------------------------------ key ops
    def select(self, keys: Iterable[str]) -> SequenceSample:
        """A new sample with only ``keys`` (tensors shared, metadata kept)."""
        keys = set(keys)
        self._require_keys(sorted(keys))
        return dataclasses.replace(
            self,
            keys=keys,
            seqlens={k: self.seqlens[k] for k in keys},
            trailing_shapes={k: self.trailing_shapes[k] for k in keys},
            dtypes={k: self.dtypes[k] for k in keys},
            data={k: self.data[k] for k in keys},
        )

    def rename(self, mapping: dict[str, str]) -> SequenceSample:
        """A new sample with keys renamed ``old -> new`` (tensors shared)."""
        self._require_keys(sorted(mapping))
        new_names = [mapping.get(k, k) for k in self.keys]
        if len(set(new_names)) != len(new_names):
            raise ValueError(
                f"SequenceSample.rename({mapping}) would give two keys the same name; "
                f"current keys: {sorted(self.keys)}"
            )

        def renamed(table: dict[str, Any]) -> dict[str, Any]:
            return {mapping.get(k, k): v for k, v in table.items()}

        return dataclasses.replace(
            self,
            keys=set(new_names),
            seqlens=renamed(self.seqlens),
            trailing_shapes=renamed(self.trailing_shapes),
            dtypes=renamed(self.dtypes),
            data=renamed(self.data),
        )

    def remap_keys_(self, mapping: dict[str, str]) -> None:
        """In-place ``rename``."""
        renamed = self.rename(mapping)
        self.keys, self.seqlens, self.data = renamed.keys, renamed.seqlens, renamed.data
        self.trailing_shapes, self.dtypes = renamed.trailing_shapes, renamed.dtypes

    def update_(self, other: SequenceSample) -> None:
        """Add or overwrite ``other``'s keys and metadata in place; ids must match in order."""
        if list(other.ids) != list(self.ids):
            raise ValueError(
                "SequenceSample.update_: ids differ (first 5: "
                f"{self.ids[:5]} vs {other.ids[:5]}); reorder the other sample to the same ids first"
            )
        self.keys |= other.keys
        self.seqlens.update(other.seqlens)
        self.trailing_shapes.update(other.trailing_shapes)
        self.dtypes.update(other.dtypes)
        self.data.update(other.data)
        self.metadata.update(other.metadata)

    def to(self, device: torch.device | str) -> SequenceSample:
        data = {k: None if t is None else t.to(device) for k, t in self.data.items()}
        return dataclasses.replace(self, data=data)

    def allclose(self, other: SequenceSample, rtol: float = 1e-5, atol: float = 1e-8) -> bool:
        """Same ids, keys, layout and metadata, and tensors equal up to tolerance."""
        if (self.ids, self.keys, self.seqlens, self.metadata) != (
            other.ids,
            other.keys,
            other.seqlens,
            other.metadata,
        ):
            return False
        if (self.trailing_shapes, self.dtypes) != (other.trailing_shapes, other.dtypes):
            return False
        for key in self.keys:
            mine, theirs = self.data[key], other.data[key]
            if (mine is None) != (theirs is None):
                return False
            if mine is not None and theirs is not None and not torch.allclose(
                mine.cpu(), theirs.cpu(), rtol=rtol, atol=atol, equal_nan=True
            ):
                return False
        return True

    # ------------------------------------------------------------------ wire format
    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """A JSON-serialisable header and the raw tensors (contiguous) to send beside it."""
        for name, values in self.metadata.items():
            for index, value in enumerate(values):
                try:
                    json.dumps(value)
                except (TypeError, ValueError) as error:
                    raise ValueError(
                        f"SequenceSample metadata {name!r} value for sample {index} "
                        f"(id {self.ids[index]!r}) is not JSON-serialisable ({error}); store "
                        "plain str/int/float/bool/None/list/dict values or put it in a tensor key"
                    ) from error
        meta = {
            "keys": sorted(self.keys),
            "ids": list(self.ids),
            "seqlens": {k: self.seqlens[k] for k in sorted(self.keys)},
            "trailing_shapes": {k: list(v) for k, v in self.trailing_shapes.items()},
            "dtypes": {k: _dtype_name(v) for k, v in self.dtypes.items()},
            "has_data": {k: self.data[k] is not None for k in self.keys},
            "metadata": self.metadata,
        }
        tensors = {k: t.contiguous() for k, t in self.data.items() if t is not None}
        return meta, tensors

    @classmethod
    def from_wire(cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> SequenceSample:
        """Inverse of ``to_wire``; validates the header against the tensors."""
        required = ("keys", "ids", "seqlens", "trailing_shapes", "dtypes", "has_data", "metadata")
        missing = [name for name in required if name not in meta]
        if missing:
            raise ValueError(f"SequenceSample wire header lacks fields {missing}")
        keys = set(meta["keys"])
        expected_tensors = {k for k in keys if meta["has_data"].get(k)}
        if set(tensors) != expected_tensors:
            raise ValueError(
                f"SequenceSample wire tensors {sorted(tensors)} do not match the header's keys "
                f"with data {sorted(expected_tensors)}"
            )
        return cls(
            keys=keys,
            ids=list(meta["ids"]),
            seqlens=meta["seqlens"],
            trailing_shapes={k: tuple(v) for k, v in meta["trailing_shapes"].items()},
            dtypes={k: _dtype_from_name(v) for k, v in meta["dtypes"].items()},
            data={k: tensors.get(k) for k in keys},
            metadata=meta["metadata"],
        )

    def __repr__(self) -> str:
        layout = ", ".join(
            f"{k}: {self.total_tokens(k)}x{self.trailing_shapes[k]} {_dtype_name(self.dtypes[k])}"
            for k in sorted(self.keys)
        )
        return f"SequenceSample(bs={self.bs}, {layout}, metadata={sorted(self.metadata)})"
