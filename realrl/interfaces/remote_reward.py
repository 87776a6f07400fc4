"""Rewards from an HTTP reward service (MFC ``remote_inf``, `reward.sources=[remote]`).

Runs on a tokenizer-only engine, like `realrl.interfaces.rule_reward`: each sequence is
decoded into its prompt (special tokens kept: the chat template as the policy read it) and
its response (a final EOS dropped, special tokens skipped), and sent with its sample's
metadata (query id, answer, task, ...) to the service in `reward.remote.url` through
`realrl.rewards.remote.RemoteRewardClient`, which retries and, past its retries, raises an
error that stops the run.
"""

from __future__ import annotations

import time

import torch

from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.api.reward_config import RemoteRewardConfig
from realrl.interfaces.base import MFCResult
from realrl.interfaces.common import one_per_sequence, require_keys, unsupported_call
from realrl.interfaces.rule_reward import decode_responses
from realrl.rewards.remote import RemoteRewardClient


class RemoteRewardInterface:
    def __init__(self, config: RemoteRewardConfig | None = None) -> None:
        self.config = config or RemoteRewardConfig()
        self.client = RemoteRewardClient(
            self.config.url, self.config.timeout_s, self.config.max_retries,
            self.config.backoff_s, self.config.max_items_per_request, self.config.token_env,
        )

    def optimizer_steps_per_call(self) -> int:
        return 0

    def inference(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """``rewards`` float32, one per sequence, as the service returns them. Stats:
        ``reward_mean``, ``request_s`` (seconds waiting for the service, back-off included)
        and ``retries`` (requests sent again during this call)."""
        tokenizer = getattr(engine, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                "remote_reward.inference needs a tokenizer to decode prompts and responses, "
                f"but the engine is {engine!r}; the reward role must be built with its "
                "tokenizer path"
            )
        require_keys(data, ("packed_input_ids", "prompt_mask"), "remote_reward.inference")
        eos_ids = {*engine.eos_token_ids, tokenizer.eos_token_id} - {None}
        items = [
            {"prompt": prompt, "response": response, "metadata": metadata}
            for prompt, response, metadata in zip(
                decode_prompts(tokenizer, data), decode_responses(tokenizer, data, eos_ids),
                per_sequence_metadata(data),
            )
        ]
        retries_before, started = self.client.retries, time.perf_counter()
        rewards = torch.tensor(self.client.score(items), dtype=torch.float32)  # [num_seqs]
        output = SequenceSample.from_tensors(
            ids=data.ids,
            seqlens={"rewards": one_per_sequence(data.seqlens["packed_input_ids"])},
            data={"rewards": rewards},
        )
        stats = {
            "reward_mean": float(rewards.mean()) if rewards.numel() else 0.0,
            "request_s": time.perf_counter() - started,
            "retries": float(self.client.retries - retries_before),
        }
        return MFCResult(data=output, stats=stats)

    def generate(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("remote_reward", "generate", "inference")

    def train_step(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("remote_reward", "train_step", "inference")


def decode_prompts(tokenizer, data: SequenceSample) -> list[str]:
    """The prompt text of each sequence, special tokens kept (as the policy read it): its
    leading `prompt_mask` tokens (an episode's later tool outputs are not the prompt)."""
    packed_input_ids = data.data["packed_input_ids"].cpu()  # [total_tokens]
    prompt_mask = data.data["prompt_mask"].cpu().bool()  # [total_tokens]
    lengths = data.seqlens_of("packed_input_ids")
    return [
        tokenizer.decode(tokens[: int(is_prompt.long().cumprod(0).sum())].tolist(),
                         skip_special_tokens=False)
        for tokens, is_prompt in zip(packed_input_ids.split(lengths), prompt_mask.split(lengths))
    ]


def per_sequence_metadata(data: SequenceSample) -> list[dict]:
    """Each sequence's sample metadata (fields that are set) plus its ``query_id``; the
    sequences of one sample (the responses to one prompt) share it."""
    metadata = []
    for index, sample_lengths in enumerate(data.seqlens["packed_input_ids"]):
        fields = {"query_id": str(data.ids[index])}
        fields |= {name: values[index] for name, values in sorted(data.metadata.items())
                   if values[index] is not None}
        metadata += [fields] * len(sample_lengths)
    return metadata
