"""Verifiable rewards (MFC ``rew_inf``): decode each response and score it by its task.

Runs on a tokenizer-only engine (``engine.module is None``) that knows the policy
checkpoint's EOS ids (``engine.eos_token_ids``: config.json's and generation_config.json's); a
response that ends with any of them, or with the tokenizer's EOS, ends there. Math answers are
checked with
`realrl.rewards.MathVerifier`, code with `realrl.rewards.CodeSandbox`, routed per sample by the
``task`` metadata. Both hold worker processes, so they are created on first use and kept
across calls; `close` stops them.
"""

from __future__ import annotations

import logging

import torch

from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.base import MFCResult
from realrl.interfaces.common import one_per_sequence, require_keys, unsupported_call
from realrl.interfaces.configs import RuleRewardConfig
from realrl.rewards import CodeSandbox, MathVerifier, score_completions

logger = logging.getLogger(__name__)


class RuleRewardInterface:
    def __init__(self, config: RuleRewardConfig) -> None:
        self.config = config
        self._math_verifier: MathVerifier | None = None
        self._code_sandbox: CodeSandbox | None = None

    def optimizer_steps_per_call(self) -> int:
        return 0

    def inference(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """``rewards`` float32, one per sequence, in ``[0, 1]``."""
        tokenizer = getattr(engine, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(
                "rule_reward.inference needs a tokenizer to decode responses, but the engine "
                f"is {engine!r}; the reward role must be built with its tokenizer path"
            )
        require_keys(data, ("packed_input_ids", "prompt_mask"), "rule_reward.inference")
        eos_ids = {*engine.eos_token_ids, tokenizer.eos_token_id} - {None}
        completions = decode_responses(tokenizer, data, eos_ids)
        tasks, answers, input_outputs = self._per_sequence_metadata(data)
        rewards = score_completions(
            completions,
            tasks,
            answers,
            input_outputs,
            self._math() if "math" in tasks else None,
            self._code() if "code" in tasks else None,
        )
        reward_tensor = torch.tensor(rewards, dtype=torch.float32)  # [num_seqs]
        output = SequenceSample.from_tensors(
            ids=data.ids,
            seqlens={"rewards": one_per_sequence(data.seqlens["packed_input_ids"])},
            data={"rewards": reward_tensor},
        )
        stats = {"task_mean": float(reward_tensor.mean()) if rewards else 0.0}
        for task in sorted(set(tasks)):
            task_rewards = [r for r, t in zip(rewards, tasks) if t == task]
            stats[f"{task}_accuracy"] = sum(r >= 1.0 for r in task_rewards) / len(task_rewards)
        return MFCResult(data=output, stats=stats)

    def _per_sequence_metadata(self, data: SequenceSample):
        """Task, math references and code tests of every sequence (a sample's sequences share
        its metadata)."""
        tasks, answers, input_outputs = [], [], []
        for index, sample_lens in enumerate(data.seqlens["packed_input_ids"]):
            task = _metadata(data, "task", index) or "math"
            references: list[str] = []
            if task == "math":
                solutions = _metadata(data, "solutions", index)
                answer = _metadata(data, "answer", index)
                references = list(solutions) if solutions else [] if answer is None else [answer]
                if not references:
                    raise ValueError(
                        f"rule_reward: math sample {data.ids[index]!r} has neither `solutions` "
                        "nor `answer` metadata; the prompt dataset must give one"
                    )
            for _ in sample_lens:
                tasks.append(task)
                answers.append([str(r) for r in references])
                input_outputs.append(_metadata(data, "input_output", index))
        return tasks, answers, input_outputs

    def _math(self) -> MathVerifier:
        if self._math_verifier is None:
            self._math_verifier = MathVerifier(
                num_workers=self.config.num_workers, timeout_s=self.config.math_timeout_s
            )
        return self._math_verifier

    def _code(self) -> CodeSandbox:
        if self._code_sandbox is None:
            self._code_sandbox = CodeSandbox(timeout_s=self.config.code_timeout_s)
        return self._code_sandbox

    def close(self) -> None:
        """Stop the math verifier's worker processes."""
        if self._math_verifier is not None:
            self._math_verifier.close()
            self._math_verifier = None

    def generate(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("rule_reward", "generate", "inference")

    def train_step(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("rule_reward", "train_step", "inference")


def _metadata(data: SequenceSample, name: str, index: int):
    values = data.metadata.get(name)
    return None if values is None else values[index]


def decode_responses(tokenizer, data: SequenceSample, eos_ids: set[int]) -> list[str]:
    """The text of each sequence's response: its model-written tokens (`prompt_mask` False), a
    final EOS (any of `eos_ids`) dropped. The model turns of an episode (`realrl.episodes`) are
    decoded one by one and joined by newlines, so that the numbers of two turns never run
    together; the tool outputs between them are not the model's and are left out."""
    packed_input_ids = data.data["packed_input_ids"].cpu()  # [total_tokens]
    prompt_mask = data.data["prompt_mask"].cpu().bool()  # [total_tokens]
    lengths = data.seqlens_of("packed_input_ids")
    completions = []
    for tokens, is_prompt in zip(packed_input_ids.split(lengths), prompt_mask.split(lengths)):
        turns = _model_turns(tokens.tolist(), is_prompt.tolist())
        if turns and turns[-1][-1] in eos_ids:
            turns[-1] = turns[-1][:-1]
        completions.append("\n".join(tokenizer.decode(turn, skip_special_tokens=True)
                                      for turn in turns))
    return completions


def _model_turns(tokens: list[int], is_prompt: list[bool]) -> list[list[int]]:
    """The runs of consecutive model tokens of one sequence, in order."""
    turns: list[list[int]] = []
    previous_is_prompt = True
    for token, prompt in zip(tokens, is_prompt):
        if not prompt:
            if previous_is_prompt:
                turns.append([])
            turns[-1].append(token)
        previous_is_prompt = prompt
    return turns
