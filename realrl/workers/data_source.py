"""The master's data: a dataset of the experiment's kind, tokenized once, served in batches.

An empty `dataset.path` selects the built-in synthetic arithmetic task (a fixed, seeded pool,
the same on every run); a path is a user JSONL file, validated line by line before anything
trains. `dataset.apply_chat_template` decides whether prompts go through the tokenizer's chat
template (see `realrl.models.tokenizer.TextFormat`); the choice is logged once. The iterator
state (epoch, position) is saved in checkpoints so recovery continues from the same sample.

Prompts owed ahead of that position: an asynchronous run with `rollout.assembly=finished_first`
trains no prefix of the data, so its checkpoint also records, by query id, the prompts drawn
and not trained (`pending_query_ids` in the state, in draw order). The source serves them
first, in full batches topped up from the iterator (the rest of the drawn batch stays owed),
so a resumed run trains every prompt once. A state without the entry owes nothing (older
checkpoints resume as before).
"""

from __future__ import annotations

import logging

from realrl.api.data import SequenceSample
from realrl.api.experiment import (
    BUILTIN_EVAL_SIZE,
    BuiltinSplit,
    BuiltinTask,
    DatasetConfig,
    DatasetKind,
    ModelKind,
    ModelSpec,
)
from realrl.datasets.arithmetic import (
    as_chat_records,
    as_paired_records,
    as_sft_records,
    make_arithmetic_splits,
)
from realrl.datasets.loader import (
    EpochIterator,
    PairedDataset,
    PromptDataset,
    SFTDataset,
    make_paired_batch,
    make_prompt_batch,
    make_sft_batch,
)
from realrl.datasets.records import (
    load_chat_records,
    load_paired_records,
    load_prompt_records,
    load_sft_records,
)
from realrl.datasets.tool_arithmetic import make_multiplication_splits
from realrl.models.tokenizer import load_tokenizer, resolve_chat_template
from realrl.workers.run_plan import RunPlan

logger = logging.getLogger(__name__)

BUILTIN_DATA_SEED = 0
BUILTIN_TRAIN_SIZE = 4096
BUILTIN_MAX_DIGITS = 2  # one- and two-digit operands: learnable by the tiny default model on a CPU


def builtin_records(kind: DatasetKind, split: BuiltinSplit = BuiltinSplit.train,
                    train_size: int = BUILTIN_TRAIN_SIZE,
                    task: BuiltinTask = BuiltinTask.arithmetic) -> list[dict]:
    """The built-in records of `task`; `train_size` takes the first problems of the fixed pool."""
    if task == BuiltinTask.multiplication:
        train, evaluation = make_multiplication_splits(BUILTIN_TRAIN_SIZE, BUILTIN_EVAL_SIZE,
                                                       seed=BUILTIN_DATA_SEED)
    else:
        train, evaluation = make_arithmetic_splits(BUILTIN_TRAIN_SIZE, BUILTIN_EVAL_SIZE,
                                                   seed=BUILTIN_DATA_SEED,
                                                   max_digits=BUILTIN_MAX_DIGITS)
    records = train[:train_size] if split == BuiltinSplit.train else evaluation
    if kind == DatasetKind.sft:
        return as_sft_records(records)
    if kind == DatasetKind.paired:
        return as_paired_records(records, seed=BUILTIN_DATA_SEED)
    if kind == DatasetKind.chat:
        return as_chat_records(records)
    return records


def load_records(kind: DatasetKind, settings: DatasetConfig) -> list[dict]:
    """Validated records: the file's (errors name file and line) or the built-in ones."""
    if not settings.path:
        return builtin_records(kind, settings.builtin_split, settings.builtin_train_size,
                               settings.builtin_task)
    loader = {DatasetKind.prompt: load_prompt_records, DatasetKind.sft: load_sft_records,
              DatasetKind.paired: load_paired_records, DatasetKind.chat: load_chat_records}[kind]
    return loader(settings.path)


def tokenizer_path(models: dict[str, ModelSpec]) -> str:
    """The checkpoint whose tokenizer encodes the dataset: the first language model's."""
    for spec in models.values():
        if spec.kind == ModelKind.lm and spec.config is not None:
            return spec.config.path
    return next(spec.config.path for spec in models.values() if spec.config is not None)


def check_chat_template(setting: bool | None, models: dict[str, ModelSpec]) -> None:
    """At launch: `dataset.apply_chat_template=true` needs a tokenizer with a chat template."""
    path = tokenizer_path(models)
    resolve_chat_template(setting, load_tokenizer(path), path)


class DataSource:
    def __init__(self, plan: RunPlan, tokenizer):
        settings = plan.dataset
        records = load_records(plan.dataset_kind, settings)
        source = settings.path or (f"built-in {settings.builtin_task.value} data "
                                   f"({settings.builtin_split.value} split)")
        chat = resolve_chat_template(settings.apply_chat_template, tokenizer,
                                     tokenizer.name_or_path)
        if plan.dataset_kind in (DatasetKind.prompt, DatasetKind.chat):
            self.dataset = PromptDataset(records, tokenizer, settings.max_prompt_len, source, chat)
            self._make_batch = make_prompt_batch
        elif plan.dataset_kind == DatasetKind.sft:
            self.dataset = SFTDataset(records, tokenizer, settings.max_seq_len, source, chat)
            self._make_batch = make_sft_batch
        else:
            self.dataset = PairedDataset(records, tokenizer, settings.max_seq_len, source, chat)
            self._make_batch = make_paired_batch
        log_text_format(settings.apply_chat_template, chat, tokenizer, self.dataset)
        # total_train_steps=0 (`gen`): one pass, so the last, partial batch is served too, and
        # joins the one before when it has fewer samples than an MFC has data-parallel ranks.
        data_parallel = max(a.strategy.data for a in plan.allocations.values())
        self.iterator = EpochIterator(len(self.dataset), settings.batch_size, plan.base.seed,
                                      drop_last=plan.base.total_train_steps > 0,
                                      min_batch_size=data_parallel)
        logger.info("%s: %d records, batch size %d, %d batches per epoch", source,
                    len(self.dataset), settings.batch_size, self.iterator.batches_per_epoch)
        self.pending: list[int] = []  # dataset indices owed before the iterator's position
        self.index_of = {query_id: index for index, query_id in enumerate(self.dataset.ids)}

    def next_batch(self) -> SequenceSample:
        """The next batch: the owed prompts first (topped up from the iterator to a full
        batch), then the iterator's."""
        if not self.pending:
            return self._make_batch(self.dataset, self.iterator.next_batch())
        if len(self.pending) < self.iterator.batch_size:
            self.pending += self.iterator.next_batch()
        batch, self.pending = (self.pending[:self.iterator.batch_size],
                               self.pending[self.iterator.batch_size:])
        return self._make_batch(self.dataset, batch)

    def owe(self, query_ids: list[str]) -> None:
        """Serve the prompts `query_ids` (drawn before and not trained) before any other."""
        self.pending = [self.index_of[str(query_id)] for query_id in query_ids] + self.pending

    def state_dict(self) -> dict:
        state = self.iterator.state_dict()
        if self.pending:
            state["pending_query_ids"] = [self.dataset.ids[index] for index in self.pending]
        return state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        pending = state.pop("pending_query_ids", [])
        self.iterator.load_state_dict(state)
        if unknown := [query_id for query_id in pending if query_id not in self.index_of]:
            raise ValueError(
                f"cannot resume the data: the checkpoint's data.pending_query_ids names "
                f"{unknown[:5]}, which this run's dataset ({len(self.dataset)} records) does "
                "not have; resume with the dataset the checkpoint was trained on"
            )
        self.pending = [self.index_of[query_id] for query_id in pending]


def log_text_format(setting: bool | None, chat: bool, tokenizer, dataset) -> None:
    """Say once how prompts were tokenized, with the first one as the model sees it."""
    if setting is None:
        has = "has a" if chat else "has no"
        setting_text = f"null, and the tokenizer {has} chat template"
    else:
        setting_text = str(setting).lower()
    how = "as one user turn of the chat template" if chat else "as they are"
    logger.info(
        "dataset.apply_chat_template=%s: prompts are tokenized %s; the first one reads %r",
        setting_text, how, tokenizer.decode(dataset.prompt_token_ids[0]),
    )
