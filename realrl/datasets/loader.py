"""Tokenized datasets, packed-batch builders, and a resumable epoch iterator.

The datasets tokenize once at start-up with a Hugging Face tokenizer, through
`realrl.models.tokenizer.TextFormat`: raw (``chat_template=False``), prompts are encoded with
special tokens (a BOS where the tokenizer uses one) and completions without them, ending with
EOS so a model learns to stop; as a chat (``chat_template=True``), a prompt is one user turn
plus the assistant header, exactly as ``tokenizer.apply_chat_template(...,
add_generation_prompt=True)`` encodes it, and a completion ends with the token the template
closes an assistant turn with. Prompt and completion are encoded separately, so the prompt
mask is exact, and length limits count the template's tokens.

Batches are ``SequenceSample``s keyed as the interfaces expect:

- prompts (RL prompt and chat records alike): ``packed_prompts`` int64
  ``[total_prompt_tokens]``, one sequence per sample; ids are query ids; metadata ``answer``,
  ``solutions``, ``task``, ``input_output``;
- SFT: ``packed_input_ids`` int64 ``[total_tokens]`` and ``prompt_mask`` bool
  ``[total_tokens]`` (True on prompt tokens), one sequence per sample;
- paired: ``packed_input_ids`` with ``2 * k`` sequences per sample interleaved
  ``pos0, neg0, pos1, neg1, ...`` and ``prompt_lens`` int64 ``[total_pairs]``, one value per
  pair (seqlens ``[[1] * k]``): the prompt length shared by that pair's two sequences.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from realrl.api.data import SequenceSample
from realrl.datasets.jsonl import DatasetError
from realrl.datasets.records import load_paired_records, load_prompt_records, load_sft_records
from realrl.models.tokenizer import TextFormat

logger = logging.getLogger(__name__)


class Tokenizer(Protocol):
    eos_token_id: int | None
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def _completion_format(tokenizer: Tokenizer, chat_template: bool) -> TextFormat:
    text_format = TextFormat(tokenizer, chat_template)
    if text_format.end_token_id is None:
        raise DatasetError(
            "the tokenizer has no eos_token_id; completions must end with EOS. Set "
            "tokenizer.eos_token (e.g. '</s>') before building SFT or paired datasets"
        )
    return text_format


def _record_ids(records: list[dict[str, Any]], source: str) -> list[str]:
    ids = [
        str(index if r.get("query_id") is None else r["query_id"])
        for index, r in enumerate(records)
    ]
    if len(set(ids)) != len(ids):
        duplicates = sorted(i for i, n in collections.Counter(ids).items() if n > 1)[:5]
        raise DatasetError(f"{source}: duplicate query ids {duplicates}; ids must be unique")
    return ids


def _drop_long(
    items: list[Any], lengths: list[int], limit: int | None, source: str, what: str
) -> list[Any]:
    if limit is None:
        return items
    kept = [item for item, length in zip(items, lengths) if length <= limit]
    if len(kept) < len(items):
        logger.info(
            "%s: dropped %d of %d records whose %s exceeds %d tokens",
            source,
            len(items) - len(kept),
            len(items),
            what,
            limit,
        )
    if not kept:
        raise DatasetError(
            f"{source}: all {len(items)} records have a {what} longer than {limit} tokens; "
            "raise the limit or shorten the data"
        )
    return kept


def _prompt_ids(text_format: TextFormat, record: dict[str, Any], source: str) -> list[int]:
    """A record's ``prompt`` (one user turn), or its ``messages`` (a chat record)."""
    if "messages" not in record:
        return text_format.prompt_ids(record["prompt"])
    try:
        return text_format.conversation_ids(record["messages"])
    except ValueError as error:
        raise DatasetError(
            f"{source}: record {record.get('query_id')!r}: {error}. Use a tokenizer with a chat "
            "template (dataset.apply_chat_template=null or true), or give the record as one "
            "'prompt'"
        ) from None


class PromptDataset:
    """Tokenized RL prompts; records longer than ``max_prompt_len`` tokens are dropped."""

    def __init__(
        self,
        records: list[dict[str, Any]],
        tokenizer: Tokenizer,
        max_prompt_len: int | None = None,
        source: str = "prompt dataset",
        chat_template: bool = False,
    ) -> None:
        text_format = TextFormat(tokenizer, chat_template)
        token_ids = [_prompt_ids(text_format, r, source) for r in records]
        pairs = _drop_long(
            list(zip(records, token_ids)),
            [len(t) for t in token_ids],
            max_prompt_len,
            source,
            "prompt",
        )
        self.records = [record for record, _ in pairs]
        self.prompt_token_ids = [tokens for _, tokens in pairs]
        self.ids = _record_ids(self.records, source)

    @classmethod
    def from_jsonl(
        cls,
        path: str | Path,
        tokenizer: Tokenizer,
        max_prompt_len: int | None = None,
        chat_template: bool = False,
    ) -> PromptDataset:
        records = load_prompt_records(path)
        return cls(records, tokenizer, max_prompt_len, str(path), chat_template)

    def __len__(self) -> int:
        return len(self.records)


class SFTDataset:
    """Tokenized ``prompt + answer + EOS`` sequences; longer than ``max_seq_len`` are dropped."""

    def __init__(
        self,
        records: list[dict[str, Any]],
        tokenizer: Tokenizer,
        max_seq_len: int | None = None,
        source: str = "SFT dataset",
        chat_template: bool = False,
    ) -> None:
        text_format = _completion_format(tokenizer, chat_template)
        encoded = [
            (text_format.prompt_ids(r["prompt"]), text_format.completion_ids(r["answer"]))
            for r in records
        ]
        items = _drop_long(
            list(zip(records, encoded)),
            [len(p) + len(a) for p, a in encoded],
            max_seq_len,
            source,
            "prompt + answer",
        )
        self.records = [record for record, _ in items]
        self.prompt_token_ids = [prompt for _, (prompt, _) in items]
        self.answer_token_ids = [answer for _, (_, answer) in items]
        self.ids = _record_ids(self.records, source)

    @classmethod
    def from_jsonl(
        cls,
        path: str | Path,
        tokenizer: Tokenizer,
        max_seq_len: int | None = None,
        chat_template: bool = False,
    ) -> SFTDataset:
        records = load_sft_records(path)
        return cls(records, tokenizer, max_seq_len, str(path), chat_template)

    def __len__(self) -> int:
        return len(self.records)


class PairedDataset:
    """Tokenized prompts with k (positive, negative) completions each, all ending with EOS."""

    def __init__(
        self,
        records: list[dict[str, Any]],
        tokenizer: Tokenizer,
        max_seq_len: int | None = None,
        source: str = "paired dataset",
        chat_template: bool = False,
    ) -> None:
        text_format = _completion_format(tokenizer, chat_template)
        completion = text_format.completion_ids
        encoded = []
        for record in records:
            prompt = text_format.prompt_ids(record["prompt"])
            pairs = [
                (completion(pos), completion(neg))
                for pos, neg in zip(record["pos_answers"], record["neg_answers"])
            ]
            encoded.append((prompt, pairs))
        longest = [len(p) + max(len(c) for pair in pairs for c in pair) for p, pairs in encoded]
        items = _drop_long(
            list(zip(records, encoded)), longest, max_seq_len, source, "longest sequence"
        )
        self.records = [record for record, _ in items]
        self.prompt_token_ids = [prompt for _, (prompt, _) in items]
        self.pair_token_ids = [pairs for _, (_, pairs) in items]
        self.ids = _record_ids(self.records, source)

    @classmethod
    def from_jsonl(
        cls,
        path: str | Path,
        tokenizer: Tokenizer,
        max_seq_len: int | None = None,
        chat_template: bool = False,
    ) -> PairedDataset:
        records = load_paired_records(path)
        return cls(records, tokenizer, max_seq_len, str(path), chat_template)

    def __len__(self) -> int:
        return len(self.records)


def make_prompt_batch(dataset: PromptDataset, indices: Sequence[int]) -> SequenceSample:
    """``packed_prompts`` ``[total_prompt_tokens]`` plus answer/task metadata per sample."""
    prompts = [dataset.prompt_token_ids[i] for i in indices]
    records = [dataset.records[i] for i in indices]
    return SequenceSample.from_default(
        ids=[dataset.ids[i] for i in indices],
        seqlens=[len(p) for p in prompts],
        data={"packed_prompts": torch.tensor([t for p in prompts for t in p], dtype=torch.int64)},
        metadata={
            name: [r.get(name) for r in records]
            for name in ("answer", "solutions", "task", "input_output")
        },
    )


def make_sft_batch(dataset: SFTDataset, indices: Sequence[int]) -> SequenceSample:
    """``packed_input_ids`` and ``prompt_mask`` ``[total_tokens]``, one sequence per sample."""
    token_ids: list[int] = []
    prompt_mask: list[bool] = []
    seqlens = []
    for i in indices:
        prompt, answer = dataset.prompt_token_ids[i], dataset.answer_token_ids[i]
        token_ids += prompt + answer
        prompt_mask += [True] * len(prompt) + [False] * len(answer)
        seqlens.append(len(prompt) + len(answer))
    return SequenceSample.from_default(
        ids=[dataset.ids[i] for i in indices],
        seqlens=seqlens,
        data={
            "packed_input_ids": torch.tensor(token_ids, dtype=torch.int64),
            "prompt_mask": torch.tensor(prompt_mask, dtype=torch.bool),
        },
    )


def make_paired_batch(dataset: PairedDataset, indices: Sequence[int]) -> SequenceSample:
    """``packed_input_ids`` with sequences ``pos0, neg0, pos1, neg1, ...`` per sample and
    ``prompt_lens`` ``[total_pairs]`` (see module docstring)."""
    token_ids: list[int] = []
    input_seqlens: list[list[int]] = []
    prompt_lens: list[int] = []
    for i in indices:
        prompt, lengths = dataset.prompt_token_ids[i], []
        for positive, negative in dataset.pair_token_ids[i]:
            for completion in (positive, negative):
                token_ids += prompt + completion
                lengths.append(len(prompt) + len(completion))
            prompt_lens.append(len(prompt))
        input_seqlens.append(lengths)
    return SequenceSample.from_tensors(
        ids=[dataset.ids[i] for i in indices],
        seqlens={
            "packed_input_ids": input_seqlens,
            "prompt_lens": [[1] * len(dataset.pair_token_ids[i]) for i in indices],
        },
        data={
            "packed_input_ids": torch.tensor(token_ids, dtype=torch.int64),
            "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int64),
        },
    )


class EpochIterator:
    """Shuffled index batches, epoch after epoch, with exactly resumable state.

    Epoch ``e`` visits ``numpy.random.default_rng([seed, e]).permutation(dataset_size)`` in
    order. The state is ``(epoch, position)``, position counting samples already served in the
    epoch, so a resumed iterator serves exactly the batches an uninterrupted one would, and a
    run resumed with a different batch size continues from the same sample.

    Without `drop_last` an epoch's last batch is partial; one that would hold fewer than
    `min_batch_size` samples (the data-parallel size that must split it) is served with the
    batch before it instead.
    """

    def __init__(self, dataset_size: int, batch_size: int, seed: int, drop_last: bool = True,
                 min_batch_size: int = 1):
        if batch_size < 1 or dataset_size < 1:
            raise ValueError(
                f"need dataset_size >= 1 and batch_size >= 1, got {dataset_size} and {batch_size}"
            )
        if drop_last and dataset_size < batch_size:
            raise ValueError(
                f"batch_size={batch_size} exceeds the dataset's {dataset_size} records, so with "
                "drop_last=True no batch would ever be served; lower the batch size"
            )
        if dataset_size < min_batch_size:
            raise ValueError(
                f"the dataset's {dataset_size} records cannot be split over {min_batch_size} "
                "data-parallel ranks (each needs one); use fewer workers or more records"
            )
        self.dataset_size, self.batch_size = dataset_size, batch_size
        self.seed, self.drop_last = seed, drop_last
        self.min_batch_size = min_batch_size
        self.epoch, self.position = 0, 0
        self._order: list[int] | None = None

    @property
    def batches_per_epoch(self) -> int:
        full, remainder = divmod(self.dataset_size, self.batch_size)
        if self.drop_last or not remainder:
            return full
        return full + (1 if remainder >= self.min_batch_size or full == 0 else 0)

    def _epoch_exhausted(self) -> bool:
        remaining = self.dataset_size - self.position
        return remaining < self.batch_size if self.drop_last else remaining <= 0

    def _next_batch_size(self) -> int:
        """`batch_size`, or what is left of the epoch when too little would stay for one more
        partial batch (without `drop_last`)."""
        remaining = self.dataset_size - self.position
        if not self.drop_last and 0 < remaining - self.batch_size < self.min_batch_size:
            return remaining
        return self.batch_size

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            generator = np.random.default_rng([self.seed, self.epoch])
            self._order = generator.permutation(self.dataset_size).tolist()
        return self._order

    def next_batch(self) -> list[int]:
        """The next batch of dataset indices, starting a new epoch when this one is done."""
        if self._epoch_exhausted():
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        batch = self._epoch_order()[self.position : self.position + self._next_batch_size()]
        self.position += len(batch)
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        """The remaining batches of the current epoch (or of the next, if this one is done)."""
        yield self.next_batch()
        while not self._epoch_exhausted():
            yield self.next_batch()

    def state_dict(self) -> dict[str, int | bool]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "dataset_size": self.dataset_size,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        for name in ("seed", "dataset_size"):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"cannot resume the data iterator: checkpoint has {name}={state[name]} but "
                    f"this run has {name}={getattr(self, name)}; the shuffled order would differ"
                )
        if state["batch_size"] != self.batch_size:
            logger.warning(
                "resuming the data iterator with batch_size=%d (checkpoint: %d) from sample %d "
                "of epoch %d",
                self.batch_size,
                state["batch_size"],
                state["position"],
                state["epoch"],
            )
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None
