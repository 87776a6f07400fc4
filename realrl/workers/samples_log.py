"""What the master logs from the step's batch itself, beside the MFCs' statistics.

- `batch_metrics`: the mean reward the actor trains on (`reward/task_mean`, from whichever MFC
  produced the key the train MFCs read as `rewards`) and mean/std/min/max of every key named in
  `log.per_sample_keys` (`batch/<key>/...`).
- `sample_rows`: a few generated responses decoded to text, with every per-response value
  (reward, reward-model score, ...), for samples.jsonl, wandb and tensorboard.
- `GeneratedFile`: the `gen` experiment's completions, all of them, in one JSONL file.

Batch layout (see `realrl.api.data`): sample i holds `len(seqlens["packed_input_ids"][i])`
responses to one prompt; a per-response key such as `rewards` holds one value per response.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from realrl.api.data import SequenceSample
from realrl.api.dfg import MFCDef, MFCKind
from realrl.interfaces.configs import GenerationConfig
from realrl.workers.metrics_log import drop_steps_after

logger = logging.getLogger(__name__)

ROLLOUT_KEYS = ("packed_input_ids", "prompt_mask")


def train_reward_key(mfcs: Iterable[MFCDef]) -> str | None:
    """The batch key the train MFCs read as `rewards` (through their `input_key_remap`); None
    when no train MFC reads rewards (sft, rw, dpo, gen)."""
    for mfc in mfcs:
        if mfc.is_train:
            for key in mfc.input_keys:
                if mfc.input_key_remap.get(key, key) == "rewards":
                    return key
    return None


def generates_rollouts(mfcs: Iterable[MFCDef]) -> bool:
    """Whether a generate MFC writes `packed_input_ids` and `prompt_mask`: what `sample_rows`
    decodes."""
    return any(mfc.kind == MFCKind.generate and set(ROLLOUT_KEYS) <= set(mfc.output_keys)
               for mfc in mfcs)


def batch_metrics(data: SequenceSample, reward_key: str | None,
                  per_sample_keys: Iterable[str]) -> dict[str, float]:
    """`reward/task_mean` over every response trained on, and `batch/<key>/mean|std|min|max`
    over every value of each named key (std: population, 0 for one value)."""
    metrics = {}
    if reward_key is not None and data.data.get(reward_key) is not None:
        metrics["reward/task_mean"] = float(data.data[reward_key].float().mean())
    for key in per_sample_keys:
        tensor = data.data.get(key)
        if tensor is None or tensor.numel() == 0:
            continue
        values = tensor.detach().float().flatten()
        metrics |= {f"batch/{key}/mean": float(values.mean()),
                    f"batch/{key}/std": float(values.std(correction=0)),
                    f"batch/{key}/min": float(values.min()),
                    f"batch/{key}/max": float(values.max())}
    return metrics


def _per_response_keys(data: SequenceSample) -> list[str]:
    """Keys holding one scalar per response of every sample (`rewards`, `rm_scores`, ...)."""
    responses = [len(lens) for lens in data.seqlens["packed_input_ids"]]
    return sorted(key for key in data.keys
                  if data.data.get(key) is not None and data.trailing_shapes[key] == ()
                  and all(lens == [1] * n for lens, n in zip(data.seqlens[key], responses)))


def sample_rows(data: SequenceSample, tokenizer, count: int,
                reward_key: str | None) -> list[dict]:
    """Up to `count` responses, the first response of each prompt first, as
    `{"query_id", "prompt", "response", "reward", <per-response keys>, <metadata>}`, and with
    per-token weight versions (an asynchronous rollout) `token_weight_versions`, the version of
    each response token's weights. Text is
    decoded with special tokens kept: it shows what the model read and wrote (chat template,
    EOS)."""
    if count <= 0 or not set(ROLLOUT_KEYS) <= data.keys:
        return []
    lengths = data.seqlens["packed_input_ids"]  # [bs][responses of sample i]
    first_response = [0]
    for sample_lengths in lengths:
        first_response.append(first_response[-1] + len(sample_lengths))
    token_offsets = [0]
    for length in data.seqlens_of("packed_input_ids"):
        token_offsets.append(token_offsets[-1] + length)
    chosen = [(i, j) for j in range(max(map(len, lengths), default=0)) for i in range(data.bs)
              if j < len(lengths[i])][:count]
    scalar_keys = _per_response_keys(data)
    token_ids, prompt_mask = data.data["packed_input_ids"], data.data["prompt_mask"].bool()
    rows = []
    for i, j in chosen:
        response = first_response[i] + j
        span = slice(token_offsets[response], token_offsets[response + 1])
        tokens, in_prompt = token_ids[span], prompt_mask[span]
        # The prompt is the leading masked run; an episode's later masked tokens (tool
        # outputs, `realrl.episodes`) stay in the response, in order.
        prompt_len = int(in_prompt.long().cumprod(0).sum())
        row = {"query_id": data.ids[i],
               "prompt": tokenizer.decode(tokens[:prompt_len].tolist()),
               "response": tokenizer.decode(tokens[prompt_len:].tolist())}
        if reward_key in scalar_keys:
            row["reward"] = data.data[reward_key][response].item()
        row |= {key: data.data[key][response].item() for key in scalar_keys if key != reward_key}
        row |= {name: values[i] for name, values in data.metadata.items()
                if isinstance(values[i], (str, int, float, bool))}
        if "packed_weight_versions" in data.keys:  # shifted: one entry fewer per sequence
            shifted_end = span.stop - response - 1
            generated = int((~in_prompt).sum())  # the sequence's last shifted entries
            versions = data.data["packed_weight_versions"][shifted_end - generated:shifted_end]
            row["token_weight_versions"] = versions.tolist()
        rows.append(row)
    return rows


def logs_samples_at(step: int, every_steps: int) -> bool:
    """`log.samples_every_steps`: step 1 and every step divisible by it; 0: never."""
    return every_steps > 0 and (step == 1 or step % every_steps == 0)


class GeneratedFile:
    """The completions of one generation MFC (`gen`'s `genDefault`), every one of them, as JSON
    lines `{"query_id", "prompt", "completion", "no_eos", "step"}` in `<run_dir>/<output_file>`,
    plus every per-response value the step computed (`gen reward.sources=...`: `reward`, and
    `<source>_rewards` with several sources), as in samples.jsonl.

    Each step appends its batch; `finish` puts the lines in the order of the prompts in the
    dataset (the `n_samples` completions of a prompt together, in sampling order) and logs the
    mean of each reward. The prompt is the record's own text (a `messages` record: its last
    user turn); the completion is decoded without special tokens (EOS).
    """

    def __init__(self, path: Path, prompts: dict[str, str], first_step: int, tokenizer):
        self.path, self.tokenizer = path, tokenizer
        self.prompts = prompts  # query id -> prompt text, in dataset order
        drop_steps_after(path, first_step)  # the lines of steps a resumed run does again

    @classmethod
    def for_mfcs(cls, mfcs: Iterable[MFCDef], run_dir: Path, dataset, first_step: int,
                 tokenizer) -> list[GeneratedFile]:
        """One file per generation MFC of the graph (none outside `gen`); `dataset` is the
        prompt dataset the run reads (`PromptDataset`)."""
        outputs = [mfc.interface_config.output_file for mfc in mfcs
                   if isinstance(mfc.interface_config, GenerationConfig)]
        if not outputs:
            return []
        prompts = {str(id_): _prompt_text(record)
                   for id_, record in zip(dataset.ids, dataset.records)}
        return [cls(run_dir / output, prompts, first_step, tokenizer) for output in outputs]

    def append(self, step: int, data: SequenceSample) -> None:
        lengths = data.seqlens["packed_input_ids"]
        sequences = data.data["packed_input_ids"].split(data.seqlens_of("packed_input_ids"))
        masks = data.data["prompt_mask"].bool().split(data.seqlens_of("packed_input_ids"))
        no_eos = data.data["seq_no_eos_mask"].tolist()
        values = {_line_key(key): data.data[key].tolist() for key in _per_response_keys(data)
                  if key != "seq_no_eos_mask"}  # [num_seqs] each: rewards, rule_rewards, ...
        sample_of = [i for i, sample_lengths in enumerate(lengths) for _ in sample_lengths]
        lines = []
        for index, (tokens, in_prompt) in enumerate(zip(sequences, masks)):
            query_id = data.ids[sample_of[index]]
            completion = self.tokenizer.decode(tokens[~in_prompt].tolist(),
                                               skip_special_tokens=True)
            record = {"query_id": query_id, "prompt": self.prompts.get(str(query_id), ""),
                      "completion": completion, "no_eos": bool(no_eos[index]), "step": step}
            record |= {key: column[index] for key, column in values.items()}
            lines.append(json.dumps(record) + "\n")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as stream:
            stream.writelines(lines)

    def finish(self) -> None:
        """Rewrite the file in dataset order (a stable sort: sampling order within a prompt)."""
        if not self.path.is_file():
            return
        position = {query_id: index for index, query_id in enumerate(self.prompts)}
        lines = [line for line in self.path.read_text(encoding="utf-8").splitlines() if line]
        lines.sort(key=lambda line: position.get(str(json.loads(line)["query_id"]), len(position)))
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        temporary.replace(self.path)
        means = mean_rewards(json.loads(line) for line in lines)
        logger.info("%d completions in %s%s", len(lines), self.path,
                    "".join(f", mean {key} {value:.4f}" for key, value in means.items()))


def mean_rewards(lines: Iterable[dict]) -> dict[str, float]:
    """The mean of `reward` and of each `<source>_rewards` over the lines of a generated file."""
    totals: dict[str, list[float]] = {}
    for line in lines:
        for key, value in line.items():
            if key == "reward" or key.endswith("_rewards"):
                totals.setdefault(key, []).append(value)
    return {key: sum(values) / len(values) for key, values in totals.items()}


def _line_key(key: str) -> str:
    """A per-response batch key's name in a generated line (`rewards` -> `reward`)."""
    return "reward" if key == "rewards" else key


def _prompt_text(record: dict) -> str:
    """The text that names a record's prompt: its `prompt`, or its last user turn."""
    if "messages" in record:
        return next((message["content"] for message in reversed(record["messages"])
                     if message["role"] == "user"), "")
    return record.get("prompt", "")

