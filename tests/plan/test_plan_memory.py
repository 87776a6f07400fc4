"""Peak memory per device against hand-computed cases (model: `plan_fixtures.TINY`, 1352
parameters; 3 sequences of 4 tokens = 12 tokens)."""

from __future__ import annotations

import dataclasses

import pytest
from plan_fixtures import layout, work

from realrl.plan.costs import WorkKind
from realrl.plan.memory import held_bytes, peak_bytes_per_device, transient_bytes


def test_held_bytes_are_weights_plus_gradients_and_adam_state_when_training():
    train = work(WorkKind.train_step)
    assert held_bytes(train, layout([0]), trains=False, shard_optimizer=False) == 1352 * 4
    # fp32: weights 4 + gradients 4 + Adam moments 8 bytes per parameter
    assert held_bytes(train, layout([0]), trains=True, shard_optimizer=False) == 1352 * 16
    # the distributed optimizer divides the moments over 2 data-parallel ranks: 4 + 4 + 4
    assert held_bytes(train, layout([0, 1], data=2), trains=True,
                      shard_optimizer=True) == 1352 * 12
    # bf16: 2 + 2 + 8 + an fp32 master copy 4
    bf16 = dataclasses.replace(train, dtype="bfloat16")
    assert held_bytes(bf16, layout([0]), trains=True, shard_optimizer=False) == 1352 * 16
    # tensor parallelism shards all of it
    assert held_bytes(train, layout([0, 1], tensor=2), trains=True,
                      shard_optimizer=False) == 1352 * 8


def test_transient_bytes_of_inference_training_and_generation():
    # inference: one chunk of logits, 12 tokens x 10 x 4 B, + 12 x 8 x 8 x 4 B of temporaries
    assert transient_bytes(work(WorkKind.inference), layout([0])) == 480 + 3072
    # train: 12 tokens x 2 layers x (16 x 8 + 4 x 16 = 192 values) x 4 B = 18432 activations
    # + logits and their gradient 2 x 12 x 10 x 4 B
    assert transient_bytes(work(WorkKind.train_step), layout([0])) == 18432 + 960
    # two micro-batches halve it
    assert transient_bytes(work(WorkKind.train_step), layout([0], microbatches=2)) == 9696
    # generate: KV cache 3 rows x 4 tokens x 2 layers x 2 x 4 x 4 B = 768, logits 3 x 10 x 4,
    # prefill activations 3 x 2 tokens x 8 x 8 x 4 B = 1536
    assert transient_bytes(work(WorkKind.generate), layout([0])) == 768 + 120 + 1536
    assert transient_bytes(work(WorkKind.rule, model=None), layout([0])) == 0


def test_a_plan_holds_one_copy_per_role_and_layout_and_the_largest_transient():
    works = {"actor_gen": work(WorkKind.generate, name="actor_gen"),
             "actor_train": work(WorkKind.train_step, name="actor_train")}
    same = {"actor_gen": layout([0]), "actor_train": layout([0])}
    # one trained copy (1352 x 16) and the train call's transient
    assert peak_bytes_per_device(works, same) == {0: 21632 + 19392}
    split = {"actor_gen": layout([0, 1], data=2), "actor_train": layout([0])}
    # rank 0 also holds the generation layout's copy (5408 B); generation's transient at d2:
    # KV 384 + logits 60 + prefill 768 = 1212
    peaks = peak_bytes_per_device(works, split)
    assert peaks[0] == pytest.approx(21632 + 5408 + 19392)
    assert peaks[1] == pytest.approx(5408 + 1212)
