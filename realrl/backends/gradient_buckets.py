"""Data-parallel gradient sums that overlap the backward, as in PyTorch DDP (Li et al. 2020).

`TorchEngine` keeps a trainable model's gradients (or, for a bf16 model, its fp32 main
gradients) as views into flat buckets of about `torch_optimizer.GRADIENT_BUCKET_BYTES`, summed
over the data-parallel group while the last micro-batch's backward still runs; see there for
the measurements behind it, and `realrl.backends.shared_memory` for the CPU sum in shared
memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from realrl.backends import shared_memory


class GradientBuckets:
    """The trainable parameters' gradients as views into flat buckets, summed over the
    data-parallel group while the backward still runs.

    Buckets take the parameters in reverse registration order, roughly the order in which
    the backward finishes their gradients. While `armed` (the last micro-batch's backward),
    a hook counts each bucket's finished gradients, and a complete bucket's all-reduce starts
    at once (asynchronously), provided every earlier bucket has started: all ranks must issue
    their collectives in the same order. `finish` starts the rest (buckets with a parameter
    the backward did not reach, e.g. on a rank without data) and waits for all of them.

    The views stay `.grad` across steps (`zero` clears them in place), so the backward adds
    into the buckets and nothing is copied in or out.

    With `use_shared_memory` and a CPU group whose ranks all share this machine's memory, the
    buckets are views of a `SharedMemorySum` instead, and `finish` sums them there (nothing is
    sent during the backward).

    `parameters` are the tensors whose `.grad` the buckets hold: the module's parameters, or
    the fp32 masters of a low-precision module (`MasterWeights`), whose main gradients its own
    hooks fill and report through `gradient_done` (`hook_backward=False`).
    """

    def __init__(
        self,
        parameters: list[torch.nn.Parameter],
        group,
        bucket_bytes: int,
        use_shared_memory: bool = True,
        hook_backward: bool = True,
    ) -> None:
        self.group = group
        self.parameters = parameters
        self.members: list[list[torch.nn.Parameter]] = []
        open_buckets: dict[tuple, list[torch.nn.Parameter]] = {}
        for parameter in reversed(parameters):
            key = (parameter.dtype, parameter.device)
            members = open_buckets.setdefault(key, [])
            members.append(parameter)
            if sum(p.numel() for p in members) * parameter.element_size() >= bucket_bytes:
                self.members.append(open_buckets.pop(key))
        self.members.extend(open_buckets.values())
        specs = [(sum(p.numel() for p in members), members[0].dtype) for members in self.members]
        self.shared: shared_memory.SharedMemorySum | None = None
        if use_shared_memory and all(m[0].device.type == "cpu" for m in self.members):
            self.shared = shared_memory.SharedMemorySum.connect(group, specs)
        if self.shared is not None:
            self.buckets = self.shared.tensors
        else:
            self.buckets = [
                torch.zeros(numel, dtype=dtype, device=members[0].device)
                for (numel, dtype), members in zip(specs, self.members)
            ]
        self.bucket_of = {
            id(parameter): index
            for index, members in enumerate(self.members)
            for parameter in members
        }
        self.armed = False
        self.waiting: list[int] = []  # per bucket: gradients the backward has yet to finish
        self.launched = 0
        self.works: list = []
        # Shared-memory sums run after the backward: nothing to start while it runs.
        self.hooks = [] if self.shared is not None or not hook_backward else [
            p.register_post_accumulate_grad_hook(self.gradient_done) for p in parameters
        ]

    def zero(self) -> None:
        """Zero every gradient and (re)attach each parameter's `.grad` to its bucket."""
        for flat, members in zip(self.buckets, self.members):
            flat.zero_()
            offset = 0
            for parameter in members:
                view = flat[offset : offset + parameter.numel()].view_as(parameter)
                if parameter.grad is None or parameter.grad.data_ptr() != view.data_ptr():
                    parameter.grad = view
                offset += parameter.numel()

    def arm(self) -> None:
        """The next backward is the step's last: start each bucket's all-reduce when it is done."""
        self.armed = True
        self.waiting = [len(members) for members in self.members]
        self.launched = 0
        self.works = []

    def gradient_done(self, parameter: torch.nn.Parameter) -> None:
        """The backward has finished `parameter`'s gradient (one of `parameters`)."""
        if self.armed and self.shared is None:
            self.waiting[self.bucket_of[id(parameter)]] -= 1
            self._launch(complete_only=True)

    def _launch(self, complete_only: bool) -> None:
        while self.launched < len(self.buckets) and (
            not complete_only or self.waiting[self.launched] == 0
        ):
            flat = self.buckets[self.launched]
            self.works.append(dist.all_reduce(flat, group=self.group, async_op=True))
            self.launched += 1

    def finish(self) -> None:
        """Start what is left and wait until every bucket holds the sum over the group."""
        if not self.armed:
            self.arm()
        if self.shared is not None:
            self.shared.all_reduce()
        else:
            self._launch(complete_only=False)
            for work in self.works:
                work.wait()
        for flat, members in zip(self.buckets, self.members):
            start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
            if any(p.grad is None or not start <= p.grad.data_ptr() < end for p in members):
                raise RuntimeError(
                    "a parameter's .grad was replaced during the step, so its bucket's "
                    "data-parallel sum missed it; only TorchEngine may set gradients"
                )
        self.armed = False
        self.works = []

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
