"""bf16's tolerance for weights trained two ways from the same start (shared by the CPU-rank and
GPU tests of the training backends)."""

from __future__ import annotations

import torch


def assert_within_a_bf16_spacing(got: torch.Tensor, expected: torch.Tensor,
                                 bit_equal: float) -> None:
    """Every weight within one bf16 spacing (|w| x 2^-7, 8 significant bits; for |w| < 2^-6
    that of 2^-6: masters an fp32 rounding apart round to bf16 values many of their own
    spacings apart near zero), and at least `bit_equal` of them equal."""
    spacing = expected.abs().clamp(min=2**-6) * 2**-7
    spacings_apart = ((got - expected).abs() / spacing).max().item()
    equal = (got == expected).float().mean().item()
    summary = (f"{equal:.4%} of {expected.numel()} weights bit-equal (need {bit_equal:.0%}), "
               f"the farthest {spacings_apart:.2f} bf16 spacings apart (need <= 1)")
    print(f"[bf16 tolerance] {summary}")
    assert spacings_apart <= 1 and equal >= bit_equal, summary
