"""The cost model's pieces against hand-computed cases (the arithmetic is in the comments).

Model and device: `plan_fixtures` (1352 parameters, 576 matmul parameters per layer; 1000
FLOP/s; 37856 B/s memory bandwidth; intra-node link 100 B/s + 0.5 s, inter-node 10 B/s + 2 s).
Work: 3 sequences of 2 prompt + 2 generated tokens = 12 tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
from plan_fixtures import TINY, cluster, device, layout, work

from realrl.plan.costs import (
    Cluster,
    ModelShape,
    WorkKind,
    compute_seconds,
    gradient_seconds,
    pipeline_seconds,
    realloc_seconds,
    ring_all_reduce_seconds,
    tensor_parallel_seconds,
    transfer_seconds,
)
from realrl.plan.devices import Link


def test_model_shape_counts_parameters_and_forward_flops():
    assert TINY.key_value_size == 4
    assert TINY.layer_matmul_parameters == 576  # 8*(8+8) + 64 + 3*8*16
    assert TINY.num_parameters == 1352  # 2*(576+16) + 80 + 8 + 80
    # tied: the head is the embedding; a value head is h numbers
    assert dataclasses.replace(TINY, tied_embeddings=True).num_parameters == 1352 - 80
    assert dataclasses.replace(TINY, value_head=True).num_parameters == 1352 - 80 + 8
    # 2*(2*576 + 80) + 4*2*8*6 = 2464 + 384
    assert TINY.forward_flops_per_token(6) == 2848


def test_model_shape_reads_a_hugging_face_config():
    config = {"num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16,
              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10}
    assert ModelShape.from_hf_config(config) == TINY
    assert ModelShape.from_hf_config({**config, "tie_word_embeddings": True},
                                     value_head=True).value_head


def test_a_head_dim_of_its_own_and_qk_norms_count_like_transformers_model():
    # Qwen3: 4 heads x 32 against a hidden size of 64; the parameters of transformers' model
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64,
              "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "vocab_size": 100, "tie_word_embeddings": True}
    shape = ModelShape.from_hf_config(config)
    assert (shape.query_size, shape.key_value_size) == (128, 64)
    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    assert shape.num_parameters == sum(p.numel() for p in model.parameters())
    # attention scores and sums: 4 x layers x (heads x head_dim) x context per token
    assert shape.body_flops_per_token(10) - shape.body_flops_per_token(0) == 4 * 2 * 128 * 10


def test_inference_compute_divides_tokens_over_data_and_flops_over_tensor_ranks():
    # 12 tokens x (2464 + 4*2*8*2 = 2592 FLOPs at context 2) / 1000 FLOP/s = 31.104 s
    inference = work(WorkKind.inference)
    assert compute_seconds(inference, layout([0]), device()) == pytest.approx(31.104)
    assert compute_seconds(inference, layout([0, 1, 2], data=3), device()) == pytest.approx(10.368)
    assert compute_seconds(inference, layout([0, 1], tensor=2), device()) == pytest.approx(15.552)


def test_the_lm_head_runs_in_float32_while_the_layers_run_in_the_weights_dtype():
    # bf16 layers at 2000 FLOP/s: 2 x 2 x 576 + 4 x 2 x 8 x 2 = 2432 FLOPs per token; the
    # head's 2 x 80 = 160 FLOPs at the float32 1000 FLOP/s: 12 x (1.216 + 0.16) s
    both = dataclasses.replace(device(), flops_per_s={"float32": 1000.0, "bfloat16": 2000.0})
    inference = dataclasses.replace(work(WorkKind.inference), dtype="bfloat16")
    assert compute_seconds(inference, layout([0]), both) == pytest.approx(16.512)


def test_overheads_count_per_layer_and_micro_batch_and_pipeline_bubbles_stretch_time():
    inference = work(WorkKind.inference)
    # 1 pass x 2 micro-batches x 2 layers x 0.5 s on top of 31.104 s
    assert compute_seconds(inference, layout([0], microbatches=2),
                           device(overhead_s=0.5)) == pytest.approx(33.104)
    # p2: half the FLOPs per rank, (2 + 2 - 1) / 2 = 1.5x bubble: 15.552 * 1.5
    assert compute_seconds(inference, layout([0, 1], pipeline=2, microbatches=2),
                           device()) == pytest.approx(23.328)


def test_train_compute_is_three_forwards_and_adam_over_memory_bandwidth():
    # 3 x 31.104 + 1352 params x (3 x 4 + 16) bytes / 37856 B/s = 93.312 + 1.0
    train = work(WorkKind.train_step)
    assert compute_seconds(train, layout([0]), device()) == pytest.approx(94.312)


def test_generation_is_prefill_plus_decode_steps_bound_by_flops_or_bytes():
    generate = work(WorkKind.generate)
    # prefill: 3 x 2 tokens x 2528 FLOPs (context 1) = 15.168 s; decode at context 2 and 3:
    # 3 rows x 2592 / 1000 = 7.776 s and 3 x 2656 / 1000 = 7.968 s, above the byte reads
    assert compute_seconds(generate, layout([0]), device()) == pytest.approx(30.912)
    # at 1 B/s the reads rule: weights 5408 B + KV cache 3 rows x context x 2 layers x 2 x 4
    # values x 4 B (384 B at context 2, 576 B at 3)
    slow_memory = dataclasses.replace(device(), memory_bandwidth_bytes_per_s=1.0)
    assert compute_seconds(generate, layout([0]), slow_memory) == pytest.approx(
        15.168 + 5792 + 5984)


def test_ring_all_reduce_pays_two_n_minus_one_latencies_and_bandwidth_terms():
    # 6 steps x 0.5 s + 6/4 x 1000 B / 100 B/s
    assert ring_all_reduce_seconds(1000, 4, Link(100.0, 0.5)) == pytest.approx(18.0)
    assert ring_all_reduce_seconds(1000, 1, Link(100.0, 0.5)) == 0.0


def test_tensor_parallel_all_reduces_two_per_layer_in_a_forward():
    # 12 tokens x 8 x 4 B = 384 B per all-reduce of 2 ranks: 2 x 0.5 + 384 / 100 = 4.84 s;
    # 2 per layer x 2 layers
    inference = work(WorkKind.inference)
    assert tensor_parallel_seconds(inference, layout([0, 1], tensor=2),
                                   cluster()) == pytest.approx(4 * 4.84)
    assert tensor_parallel_seconds(inference, layout([0]), cluster()) == 0.0


def test_gradient_sum_crosses_the_slow_link_once_the_mesh_spans_nodes():
    train = work(WorkKind.train_step, optimizer_steps=2)
    # 1352 x 4 B = 5408 B over 2 ranks: 2 x 0.5 + 5408 / 100 = 55.08 s per optimizer step
    assert gradient_seconds(train, layout([0, 1], data=2), cluster()) == pytest.approx(2 * 55.08)
    # one device per node: 2 x 2 + 5408 / 10 = 544.8 s
    two_nodes = cluster(n_nodes=2, n_devices_per_node=1)
    assert gradient_seconds(train, layout([0, 1], data=2, n_nodes=2, per_node=1),
                            two_nodes) == pytest.approx(2 * 544.8)


def test_pipeline_sends_each_micro_batch_between_stages():
    # 12 tokens / 2 micro-batches = 6 tokens x 8 x 4 B = 192 B: 0.5 + 1.92 s, 2 micro-batches
    inference = work(WorkKind.inference)
    assert pipeline_seconds(inference, layout([0, 1], pipeline=2, microbatches=2),
                            cluster()) == pytest.approx(2 * 2.42)


def test_realloc_moves_each_target_shard_and_is_free_for_the_same_layout():
    source = layout([0])
    assert realloc_seconds(TINY, "float32", source, source, cluster()) == 0.0
    # 5408 B to each of 2 data-parallel ranks at once: 0.5 + 54.08; t2 halves the bytes
    assert realloc_seconds(TINY, "float32", source, layout([0, 1], data=2),
                           cluster()) == pytest.approx(54.58)
    assert realloc_seconds(TINY, "float32", source, layout([0, 1], tensor=2),
                           cluster()) == pytest.approx(27.54)


def test_transfer_pays_one_request_per_data_parallel_rank_and_the_batch_bytes_once():
    slow_host = Cluster(1, 4, dataclasses.replace(device(), host=Link(1000.0, 0.1)))
    inference = dataclasses.replace(work(WorkKind.inference), transfer_bytes_per_token=24)
    # 2 x 0.1 s + 12 tokens x 24 B / 1000 B/s
    assert transfer_seconds(inference, layout([0, 1], data=2), slow_host) == pytest.approx(0.488)


def test_a_link_within_one_node_is_the_fast_one():
    two_nodes = cluster(n_nodes=2, n_devices_per_node=4)
    assert two_nodes.link_within((0, 1, 2, 3)).latency_s == 0.5
    assert two_nodes.link_within((2, 3, 4, 5)).latency_s == 2.0
