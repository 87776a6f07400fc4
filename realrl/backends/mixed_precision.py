"""fp32 master weights for a low-precision (bf16) trainable model (Micikevicius et al. 2018).

Why: AdamW moves a weight by about `lr` per step (its first steps by `lr * sign(gradient)`).
A bf16 weight has 8 significant bits, so its spacing is |w| * 2^-7 up to a factor of 2, and
an update below half of it rounds away: with `lr=1e-6`, 99.7% of a tiny model's bf16 weights
were bit-identical after two optimizer steps (weights of magnitude ~0.02 need ~60 steps of
1e-6 before one bf16 spacing is crossed, and they never get there when every step rounds
back). Gradients summed over micro-batches and data-parallel ranks in bf16 lose bits too.

How (as megatron's `main_grad`): the module keeps computing in bf16; every trainable bf16
parameter has an fp32 master copy, and the optimizer (its moments included) works on the
masters only:

- during the backward, a post-accumulate-grad hook adds each micro-batch's bf16 gradient into
  the master's fp32 `.grad` (the *main gradient*) and frees the bf16 one, so micro-batches
  are summed in fp32;
- data-parallel sums (`GradientBuckets`, in shared memory or through the process group) and
  gradient clipping work on the fp32 main gradients;
- AdamW steps the masters, which are then copied, rounded to nearest, into the bf16
  parameters in place: tensors that other code holds (reallocation, kept forwards' version
  counters) stay the same tensors.

The bf16 weights are then always the masters rounded to bf16, and updates far below one bf16
spacing add up in the masters until they cross one.

Memory per trainable parameter, in bytes: fp32 training holds 4 (weights) + 4 (gradients) +
8 (AdamW's two moments) = 16; bf16 with masters 2 (bf16 weights) + 4 (fp32 masters) + 4 (fp32
main gradients) + 8 (moments) = 18, plus a transient bf16 gradient per parameter while its
backward finishes. bf16 pays off in activations (half of fp32's per token) and, on hardware
with bf16 units, in speed; frozen bf16 roles (a reference) hold 2 bytes per parameter
instead of 4.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class MasterWeights:
    """fp32 masters and main gradients of `parameters`, the trainable parameters of a module
    that computes in a lower precision. The optimizer is built on `masters`."""

    def __init__(self, parameters: list[torch.nn.Parameter]) -> None:
        self.parameters = list(parameters)
        with torch.no_grad():
            self.masters = [
                torch.nn.Parameter(p.detach().to(torch.float32, copy=True), requires_grad=False)
                for p in self.parameters
            ]
        self.master_of = {id(p): m for p, m in zip(self.parameters, self.masters, strict=True)}
        # Told of each master whose main gradient holds this backward's contribution (the
        # data-parallel buckets count them to start their sums during the backward).
        self.on_gradient: Callable[[torch.nn.Parameter], None] | None = None
        self.hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for p in parameters]

    def _accumulate(self, parameter: torch.nn.Parameter) -> None:
        """Add `parameter`'s low-precision gradient into its master's fp32 main gradient."""
        master = self.master_of[id(parameter)]
        if master.grad is None:
            master.grad = parameter.grad.to(torch.float32)
        else:
            master.grad.add_(parameter.grad)
        parameter.grad = None
        if self.on_gradient is not None:
            self.on_gradient(master)

    @torch.no_grad()
    def copy_to_module(self) -> None:
        """Write the masters, rounded to the module's precision, into its parameters in place."""
        torch._foreach_copy_(self.parameters, self.masters)

    @torch.no_grad()
    def copy_from_module(self) -> None:
        """Make the masters the module's current weights (exactly: bf16 -> fp32 is lossless),
        after something other than the optimizer wrote them."""
        torch._foreach_copy_(self.masters, self.parameters)

    def state_dict(self) -> list[torch.Tensor]:
        return [master.detach() for master in self.masters]

    def load_state_dict(self, masters: list[torch.Tensor]) -> None:
        """Restore saved masters and round them into the module."""
        check_saved_masters(masters, self.masters)
        with torch.no_grad():
            torch._foreach_copy_(self.masters, [m.to(self.masters[0].device) for m in masters])
        self.copy_to_module()


def check_saved_masters(saved: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """Raise if a checkpoint's master weights do not fit `targets` (another model or layout)."""
    shapes = [tuple(t.shape) for t in targets]
    saved_shapes = [tuple(t.shape) for t in saved]
    if saved_shapes != shapes:
        raise ValueError(
            f"the checkpoint's fp32 master weights ({len(saved)} tensors) do not match this "
            f"model's trainable parameters ({len(targets)} tensors; first difference at "
            f"{_first_difference(saved_shapes, shapes)}): resume with the model and "
            "tensor-parallel layout that wrote the checkpoint"
        )


def _first_difference(left: list[tuple], right: list[tuple]) -> str:
    for index, (a, b) in enumerate(zip(left, right)):
        if a != b:
            return f"tensor {index}: {a} vs {b}"
    return f"tensor {min(len(left), len(right))}: one list ends"
