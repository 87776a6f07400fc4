"""A generate call run in chunks of decode steps, so that new weights can arrive in the middle.

AReaL's interruptible generation (Fu et al. 2025, sec. 4.1): when the trainer publishes new
weights, generations in flight pause at a decode-step boundary, take the weights, and go on
under them. Here the pause is a chunk boundary: `InterruptibleGeneration.decode` runs at most a
chunk of steps (`realrl.models.generation.decode_steps`) and returns; whoever holds the object
(a model worker, between two requests of the master) may update the model's weights in place
before the next chunk, which names the version it runs under. Every response token records the
version of the weights whose logits chose it (`versions_per_token`), so a sequence can hold
tokens of several versions.

What happens to the key/value cache of the tokens already decoded when the version changes
(`KV_CACHE_MODES`):
- ``recompute``: run the prompt and the response so far through the new weights once (one packed
  prefill over every row), overwriting the cache; the next tokens then see exactly what the new
  model would compute for this prefix (AReaL's choice);
- ``keep``: keep the keys/values the old weights wrote; cheaper, and the next tokens' attention
  mixes old keys with new queries.
Without a version change both give the tokens of an uninterrupted call: chunks replay the same
steps with the same draws, and a recomputed cache holds the values the decode steps wrote.

Notation as in `realrl.models.generation`: `num_seqs` rows, `max_new` = `max_new_tokens`.
"""

from __future__ import annotations

import torch

from realrl.models.attention import PackedLayout
from realrl.models.generation import (
    DecodingState,
    _prefill,
    decode_steps,
    finish_decoding,
    start_decoding,
)
from realrl.models.sampling import GenerationConfig, GenerationOutput
from realrl.models.transformer import Transformer

KV_CACHE_MODES = ("recompute", "keep")


class InterruptibleGeneration:
    """One generate call, decoded chunk by chunk, each chunk under a named weight version."""

    def __init__(self, state: DecodingState, config: GenerationConfig, version: int):
        self.state = state
        self.config = config
        self.version = version  # the weights of the latest chunk
        # The version of each decode step's weights: entry s chose response token s.
        self.step_versions = [version]
        self.weight_updates = 0  # version changes seen mid-generation

    @classmethod
    @torch.no_grad()
    def start(cls, model: Transformer, packed_prompts: torch.Tensor,
              prompt_cu_seqlens: torch.Tensor, config: GenerationConfig,
              generator: torch.Generator, version: int) -> InterruptibleGeneration:
        """Prefill `packed_prompts` [total_prompt_tokens] (`prompt_cu_seqlens` [num_prompts +
        1]) under weights `version` and choose the first tokens; no decode step runs yet."""
        state = start_decoding(model, packed_prompts, prompt_cu_seqlens, config, generator)
        return cls(state, config, version)

    @torch.no_grad()
    def decode(self, model: Transformer, steps: int, version: int, kv_cache: str) -> bool:
        """Run at most `steps` decode steps (all that are left when `steps <= 0`) under weights
        `version`; when it differs from the last chunk's, first bring the cache to the new
        weights as `kv_cache` says. Returns whether the generation is done."""
        if kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"unknown kv_cache={kv_cache!r}; valid: {', '.join(KV_CACHE_MODES)}")
        state = self.state
        if state.done:
            return True
        if bool(state.record.finished.all()):  # ended inside the last chunk: nothing to swap
            state.done = True
            return True
        if version != self.version:
            self.weight_updates += 1
            if kv_cache == "recompute":
                self._recompute_cache(model)
            self.version = version
        first = state.next_step
        stop = self.config.max_new_tokens if steps <= 0 else first + steps
        done = decode_steps(model, self.config, state, stop)
        self.step_versions.extend([version] * (state.next_step - first))
        return done

    def _recompute_cache(self, model: Transformer) -> None:
        """Overwrite the cache of every row's prompt and response tokens fed so far (all but
        the last chosen one, which the next step feeds) with the current weights' keys/values.

        A row's prompt sits left-padded to end at column `prompt_columns` and its response token
        j at column `prompt_columns + j`, so one packed prefill over the rows writes them where
        the decode steps did (`realrl.models.generation._prefill`).
        """
        state, decoding = self.state, self.state.decoding
        fed = state.next_step - 1  # response tokens in the cache
        row_prompt_lens = decoding.row_prompt_lens  # [num_seqs]
        prompts = state.packed_prompts.split(state.prompt_lens.tolist())
        pieces = []
        for row in range(row_prompt_lens.numel()):
            pieces += [prompts[row // state.n], state.record.tokens[row, :fed]]
        lengths = row_prompt_lens + fed  # [num_seqs]
        cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
        cu_seqlens[1:] = lengths.cumsum(0)
        layout = PackedLayout.from_cu_seqlens(cu_seqlens)
        pad_offsets = decoding.prompt_columns - row_prompt_lens
        _prefill(model, torch.cat(pieces), layout, state.cache, pad_offsets)

    def output(self) -> tuple[GenerationOutput, torch.Tensor]:
        """The packed output (`realrl.models.sampling.pack_outputs`) and the weight version of
        every response token, `[total_response_tokens]` long, packed like `packed_logprobs`."""
        output = finish_decoding(self.state)
        versions = torch.tensor(self.step_versions, dtype=torch.long)  # [steps_done]
        lengths = output.response_lens.long().cpu().tolist()
        per_token = torch.cat([versions[:length] for length in lengths]) if lengths else versions
        return output, per_token
