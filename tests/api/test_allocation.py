import pytest

from realrl.api.allocation import (
    AllocationError,
    DeviceMesh,
    MFCAllocation,
    ParallelStrategy,
    format_allocation_table,
    format_ranks,
    parse_ranks,
    validate_model_divisibility,
)
from realrl.api.allocation_mode import default_allocation, parse_allocation_mode

MFC_NAMES = ["actor_gen", "ref_inf", "actor_train"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("d2t2", ParallelStrategy(2, 2, 1)),
        ("d2p2t1", ParallelStrategy(2, 1, 2)),
        ("t4", ParallelStrategy(1, 4, 1)),
        ("P2D3", ParallelStrategy(3, 1, 2)),
    ],
)
def test_parallel_strategy_parses_letters_in_any_order(text, expected):
    assert ParallelStrategy.parse(text) == expected


@pytest.mark.parametrize("text", ["", "d2x2", "d2d2", "2d", "d0", "d2 t2 junk"])
def test_parallel_strategy_rejects_bad_text_naming_it_and_showing_examples(text):
    with pytest.raises(ValueError, match=f"invalid parallel layout '{text}'.*e.g. 'd2t1p1'"):
        ParallelStrategy.parse(text)


def test_parallel_strategy_prints_and_counts_devices():
    strategy = ParallelStrategy(data=2, tensor=4, pipeline=3)
    assert str(strategy) == "d2t4p3"
    assert strategy.world_size == 24
    assert ParallelStrategy.parse(str(strategy)) == strategy


def test_rank_lists_parse_and_print_compactly():
    assert parse_ranks("0-3") == (0, 1, 2, 3)
    assert parse_ranks("6, 0-1,4") == (0, 1, 4, 6)
    assert format_ranks((0, 1, 2, 3)) == "0-3"
    assert format_ranks((0, 2)) == "0,2"
    assert format_ranks((0, 1, 4, 5, 6, 9)) == "0-1,4-6,9"
    with pytest.raises(ValueError, match="invalid rank list '0-a'"):
        parse_ranks("0-a")
    with pytest.raises(ValueError, match="names a rank twice"):
        parse_ranks("0-2,1")


def test_device_mesh_subset_overlap_and_bounds():
    full = DeviceMesh.full(2, 2)
    left = DeviceMesh(2, 2, (1, 0))
    right = DeviceMesh(2, 2, (2, 3))
    assert str(full) == "0-3" and str(left) == "0-1" and left.ranks == (0, 1)
    assert left.is_subset_of(full) and not full.is_subset_of(left)
    assert not left.overlaps(right) and left.overlaps(full)
    with pytest.raises(ValueError, match=r"ranks \[4\] are outside the cluster of 4 devices"):
        DeviceMesh(2, 2, (3, 4))


def test_coordinates_put_tensor_fastest_then_pipeline_then_data():
    # mesh ranks 8..15 with d2p2t2: local i = (dp * 2 + pp) * 2 + tp
    allocation = MFCAllocation(
        "actor_train", DeviceMesh(2, 8, tuple(range(8, 16))), ParallelStrategy(2, 2, 2)
    )
    assert allocation.coordinates_of(8) == (0, 0, 0)
    assert allocation.coordinates_of(9) == (0, 0, 1)  # tp
    assert allocation.coordinates_of(10) == (0, 1, 0)  # pp
    assert allocation.coordinates_of(13) == (1, 0, 1)  # local 5 = (1*2+0)*2+1
    assert allocation.rank_at(dp=1, pp=1, tp=1) == 15
    assert allocation.ranks_of_dp_rank(1) == [12, 13, 14, 15]
    assert allocation.dp_head_ranks() == [10, 14]  # tp0 of the last stage, pp=1
    assert allocation.tensor_groups() == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert allocation.pipeline_groups() == [[8, 10], [9, 11], [12, 14], [13, 15]]
    assert allocation.data_groups() == [[8, 12], [9, 13], [10, 14], [11, 15]]
    with pytest.raises(ValueError, match="rank 0 is not in the mesh 8-15"):
        allocation.coordinates_of(0)


def test_allocation_rejects_layout_that_does_not_fill_its_mesh():
    with pytest.raises(
        AllocationError, match="layout d2t2p1 uses 4 devices but its mesh 0-1 has 2"
    ):
        MFCAllocation("actor_train", DeviceMesh(1, 2, (0, 1)), ParallelStrategy(2, 2))


def test_global_layout_puts_every_mfc_on_the_whole_cluster():
    allocations = parse_allocation_mode("d2t1", MFC_NAMES, n_nodes=1, n_devices_per_node=2)
    assert list(allocations) == MFC_NAMES
    for name, allocation in allocations.items():
        assert allocation.mfc_name == name
        assert allocation.mesh == DeviceMesh.full(1, 2)
        assert allocation.strategy == ParallelStrategy(2)


def test_per_mfc_layouts_and_wildcard_default():
    allocations = parse_allocation_mode("actor_gen:d4, actor_train:d2t2, *:t4", MFC_NAMES, 1, 4)
    assert allocations["actor_gen"].strategy == ParallelStrategy(4)
    assert allocations["actor_train"].strategy == ParallelStrategy(2, 2)
    assert allocations["ref_inf"].strategy == ParallelStrategy(1, 4)


def test_explicit_meshes_accept_ranges_and_lists():
    allocations = parse_allocation_mode(
        "actor_gen:d2@0-1,ref_inf:d2@2,3,actor_train:d1t2@0,3", MFC_NAMES, 2, 2
    )
    assert allocations["actor_gen"].mesh.ranks == (0, 1)
    assert allocations["ref_inf"].mesh.ranks == (2, 3)
    assert allocations["actor_train"].mesh.ranks == (0, 3)
    assert not allocations["actor_gen"].mesh.overlaps(allocations["ref_inf"].mesh)


def test_auto_mode_uses_the_default_heuristic():
    assert parse_allocation_mode("auto", MFC_NAMES, 1, 2) == default_allocation(MFC_NAMES, 1, 2)


def test_parse_collects_every_problem_into_one_error():
    with pytest.raises(AllocationError) as caught:
        parse_allocation_mode(
            "actor_gen:d3@0-1,critic_inf:d2,ref_inf:x2,actor_train:d1@7", MFC_NAMES, 1, 4
        )
    message = str(caught.value)
    assert "does not fit the cluster of 4 device(s)" in message
    assert "MFC 'actor_gen': layout d3t1p1 uses 3 devices but its mesh 0-1 has 2; try 'd2t1p1'" in (
        message
    )
    assert "unknown MFC 'critic_inf'; valid names: actor_gen, ref_inf, actor_train" in message
    assert "MFC 'ref_inf': invalid parallel layout 'x2'" in message
    assert "MFC 'actor_train': DeviceMesh ranks [7] are outside the cluster of 4 devices" in message
    assert len(message.splitlines()) == 5  # header + the four problems


def test_parse_reports_missing_mfcs_and_suggests_fitting_layouts():
    with pytest.raises(AllocationError, match="MFC\\(s\\) ref_inf, actor_train have no allocation"):
        parse_allocation_mode("actor_gen:d2", MFC_NAMES, 1, 2)
    with pytest.raises(
        AllocationError,
        match="every MFC \\('\\*'\\): layout d2t2p1 uses 4 .*try 'd4t2p1' or 'd2t4p1' or 'd8t1p1'",
    ):
        parse_allocation_mode("d2t2", MFC_NAMES, 1, 8)
    with pytest.raises(AllocationError, match="'actor_gen' is allocated twice"):
        parse_allocation_mode("actor_gen:d1@0,actor_gen:d1@1,*:d2", MFC_NAMES, 1, 2)


def test_default_allocation_for_one_cpu_worker_is_d1_on_rank_zero():
    for allocation in default_allocation(MFC_NAMES, 1, 1).values():
        assert allocation.mesh.ranks == (0,) and allocation.strategy == ParallelStrategy(1)


def test_default_allocation_on_cpu_is_data_parallel_over_all_workers():
    for allocation in default_allocation(MFC_NAMES, 1, 4).values():
        assert allocation.strategy == ParallelStrategy(4) and allocation.mesh.size == 4


def test_default_allocation_on_gpu_nodes_shards_training_within_a_node():
    allocations = default_allocation(MFC_NAMES, 2, 8, is_gpu=True)
    assert allocations["actor_train"].strategy == ParallelStrategy(data=2, tensor=8)
    assert allocations["actor_gen"].strategy == ParallelStrategy(data=16)
    # tensor groups never cross a node boundary
    assert allocations["actor_train"].tensor_groups() == [list(range(8)), list(range(8, 16))]
    assert default_allocation(["actor_train"], 1, 6, True)["actor_train"].strategy.tensor == 6


def test_model_divisibility_lists_each_field_that_tensor_parallelism_cannot_split():
    allocation = MFCAllocation("actor_train", DeviceMesh.full(1, 4), ParallelStrategy(1, 4, 1))
    assert validate_model_divisibility(allocation, 8, 4, 32000, 1024) == []
    problems = validate_model_divisibility(allocation, 6, 2, 32002, 1024)
    assert problems == [
        "MFC 'actor_train': tensor parallel size 4 does not divide num_attention_heads=6; "
        "use a tensor size among [1, 2, 3]",
        "MFC 'actor_train': tensor parallel size 4 does not divide num_key_value_heads=2; "
        "use a tensor size among [1, 2]",
        "MFC 'actor_train': tensor parallel size 4 does not divide vocab_size=32002; "
        "use a tensor size among [1, 2]",
    ]
    deep = MFCAllocation("actor_train", DeviceMesh.full(1, 4), ParallelStrategy(1, 1, 4))
    assert validate_model_divisibility(deep, 8, 4, 32000, 1024, num_hidden_layers=2) == [
        "MFC 'actor_train': pipeline size 4 exceeds num_hidden_layers=2"
    ]


def test_allocation_table_shows_ranks_layout_and_coordinates():
    allocations = parse_allocation_mode("actor_gen:d2@0-1,*:d1t2@2-3", MFC_NAMES, 1, 4)
    table = format_allocation_table(allocations).splitlines()
    assert table[0].split()[:3] == ["MFC", "ranks", "layout"]
    assert table[1].split() == ["actor_gen", "0-1", "d2t1p1", "0:(0,0,0)", "1:(1,0,0)"]
    assert table[3].split() == ["actor_train", "2-3", "d1t2p1", "2:(0,0,0)", "3:(0,1,0)"]
