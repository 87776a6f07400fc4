"""`retain_freed_memory`: freed memory stays in the process (page faults counted in a child,
so that this test process keeps glibc's defaults)."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds are glibc's"
)

# Forty 2 MiB tensors, each written, then all freed, five times after two warm-up rounds: the
# pattern of a training step's activations. Whether glibc's defaults fault on them again depends
# on what the process allocated before (its thresholds adapt), so the control below pins small
# thresholds instead: then every tensor is a fresh mapping, 512 page faults each.
CHILD = textwrap.dedent("""
    import os, resource, sys, torch
    from realrl.workers.malloc import retain_freed_memory
    retained = retain_freed_memory() if sys.argv[1] == "retain" else None

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def allocate_and_free():
        tensors = [torch.ones(2**19) for _ in range(40)]
        del tensors

    allocate_and_free()
    allocate_and_free()
    before = faults()
    for _ in range(5):
        allocate_and_free()
    print(retained, (faults() - before) // 5)
""")


def faults_per_round(mode: str, **env: str) -> tuple[str, int]:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", **env},
    )
    retained, faults = result.stdout.split()
    return retained, int(faults)


def test_freed_tensors_are_reused_without_page_faults():
    small = str(128 * 2**10)
    pinned = {"MALLOC_MMAP_THRESHOLD_": small, "MALLOC_TRIM_THRESHOLD_": small}
    _, control = faults_per_round("control", **pinned)
    retained, faults = faults_per_round("retain")
    assert control >= 40 * 512  # the count sees every page the allocator hands back
    # What faults is only the interpreter's own memory (0-102 pages a round seen), not tensors.
    assert retained == "True" and faults < 40 * 512 // 20


def test_a_users_own_malloc_settings_stay_in_force():
    retained, _ = faults_per_round("retain", MALLOC_TRIM_THRESHOLD_="131072")
    assert retained == "False"
