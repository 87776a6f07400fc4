"""The frozen reference policy: log-probabilities of the sampled tokens (MFC ``ref_inf``).

PPO's KL penalty and DPO's implicit reward both compare the policy with this model on the
exact tokens of each sequence, so the output is shifted like every training quantity.
"""

from __future__ import annotations

from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.base import MFCResult
from realrl.interfaces.common import require_engine, shifted_logprobs, unsupported_call
from realrl.interfaces.configs import ReferenceConfig

OUTPUT_KEY = "packed_ref_logprobs"


class ReferenceInterface:
    """``inference``: ``packed_input_ids`` -> ``packed_ref_logprobs`` float32, shifted
    ``[total_tokens - num_seqs]``, computed micro-batch by micro-batch without gradients."""

    def __init__(self, config: ReferenceConfig | None = None) -> None:
        self.config = config or ReferenceConfig()

    def inference(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        engine = require_engine(engine, "reference", "inference")
        return MFCResult(data=shifted_logprobs(engine, data, microbatch, OUTPUT_KEY))

    def generate(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("reference", "generate", "inference")

    def train_step(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("reference", "train_step", "inference")

    def optimizer_steps_per_call(self) -> int:
        return 0
