"""The contract between a model worker and the role-specific code that runs an MFC.

A worker calls exactly one of `generate`, `inference` or `train_step` per MFC request, with the
engine of the model shard (module, tokenizer, optimizer, process groups; None for rule-based
roles) and this data-parallel rank's part of the batch. A train MFC that declares
`forward_keys` also gets a request for `train_forward` (its forward on those keys alone,
before its other inputs exist; `PPOActorInterface.train_forward`); only such interfaces need
that method. Interfaces are plain classes constructed
from their typed config; `realrl.interfaces.registry.make_interface` picks one by the MFC's
interface name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.backends.torch_engine import TorchEngine


@dataclass
class MFCResult:
    """New keys for the samples of the request (same ids, same order; None for train steps)
    and statistics. Train-step statistics must already be reduced over the data-parallel group;
    generate/inference statistics are averaged over data-parallel ranks by the master."""

    data: SequenceSample | None = None
    stats: dict[str, float] = field(default_factory=dict)


class Interface(Protocol):
    def generate(self, engine: TorchEngine | None, data: SequenceSample,
                 microbatch: MicroBatchSpec) -> MFCResult: ...

    def inference(self, engine: TorchEngine | None, data: SequenceSample,
                  microbatch: MicroBatchSpec) -> MFCResult: ...

    def train_step(self, engine: TorchEngine, data: SequenceSample,
                   microbatch: MicroBatchSpec) -> MFCResult: ...

    def optimizer_steps_per_call(self) -> int:
        """How many optimizer steps one `train_step` takes (sizes the LR schedule)."""
        ...
