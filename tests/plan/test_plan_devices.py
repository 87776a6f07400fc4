"""Device descriptions: analytic GPUs from datasheets, this machine's CPU from a cached profile."""

from __future__ import annotations

import json

import pytest

from realrl.plan import devices


def test_an_analytic_h100_takes_55_percent_of_its_dense_peak_and_80_percent_of_bandwidth():
    h100 = devices.analytic_device("h100")
    assert h100.flops("bfloat16") == pytest.approx(0.55 * 989e12)
    assert h100.memory_bandwidth_bytes_per_s == pytest.approx(0.8 * 3.35e12)
    # NVLink 450 GB/s per direction within a node, one 400 Gb/s NIC per GPU between nodes
    assert h100.intra_node.bandwidth_bytes_per_s == pytest.approx(0.8 * 450e9)
    assert h100.inter_node.bandwidth_bytes_per_s == pytest.approx(0.8 * 50e9)
    with pytest.raises(KeyError, match="unknown device kind 'v100'; known: h100, h200, a100"):
        devices.analytic_device("v100")
    with pytest.raises(KeyError, match="has no FLOP/s for dtype 'int8'"):
        h100.flops("int8")


def test_the_cpu_profile_is_read_from_the_cache_per_machine_and_thread_count(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("REALRL_CACHE", str(tmp_path))
    profile = {"threads": 2, "matmul_float32_flops_per_s": 1e11,
               "matmul_bfloat16_flops_per_s": 2e11, "copy_bytes_per_s": 1e10,
               "layer_overhead_s": 1e-4}
    path = devices.profile_cache_path(2)
    assert path.parent == tmp_path / "plan" and path.name.startswith("cpu-2t-")
    assert path.name.endswith(f"-v{devices.PROFILE_VERSION}.json")
    assert devices.profile_cache_path(1) != path
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(profile))
    cpu = devices.cpu_device(2, memory_bytes=8e9)  # no profiling run: the cache answers
    assert cpu.flops("float32") == 1e11 and cpu.flops("bfloat16") == 2e11
    assert cpu.memory_bytes == 8e9 and cpu.kernel_overhead_s == 1e-4 and not cpu.is_gpu


def test_the_calibration_measures_a_two_process_gloo_all_reduce():
    from realrl.plan.calibrate import gloo_all_reduce

    link = gloo_all_reduce(threads=1)
    # loopback between two processes: well under 50 ms a step, and at least 10 MB/s
    assert 0 < link["gloo_latency_s"] < 0.05
    assert link["gloo_bandwidth_bytes_per_s"] > 1e7
    cpu = devices.cpu_device_from_profile(
        {"threads": 1, "matmul_float32_flops_per_s": 1e11, "matmul_bfloat16_flops_per_s": 2e11,
         "copy_bytes_per_s": 1e10, "layer_overhead_s": 1e-4, **link}, memory_bytes=8e9)
    assert cpu.intra_node.latency_s == link["gloo_latency_s"]
    assert cpu.intra_node.bandwidth_bytes_per_s == link["gloo_bandwidth_bytes_per_s"]


def test_gloo_link_by_hand_and_its_floor_when_the_medians_disagree():
    from realrl.plan.calibrate import LARGE_ALL_REDUCE_VALUES, gloo_link

    large_bytes = LARGE_ALL_REDUCE_VALUES * 4  # 8 MiB
    # 0.4 ms for 8 KB (2 steps of 0.2 ms); 20.4 ms for 8 MiB: 20 ms of bytes
    link = gloo_link(4e-4, 2.04e-2)
    assert link["gloo_latency_s"] == pytest.approx(2e-4)
    assert link["gloo_bandwidth_bytes_per_s"] == pytest.approx(large_bytes / 2e-2)
    # a small median above the large one (a loaded moment): the bytes take half the large time
    assert gloo_link(3e-2, 2e-2)["gloo_bandwidth_bytes_per_s"] == pytest.approx(
        large_bytes / 1e-2)
