"""Generation settings, the output record, and the per-step token selection of `generate`."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch


@dataclasses.dataclass
class GenerationConfig:
    """How to sample. `top_k=0` and `top_p=1.0` switch those filters off.

    `eos_token_id=None` takes the model config's EOS id(s); `stop_token_ids` end a response
    in addition to EOS. A stop/EOS token is kept as the last response token. Before
    `min_new_tokens` response tokens exist, stop/EOS logits are masked out of the sampling
    distribution (not out of the reported log-probs).
    """

    n: int = 1
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    eos_token_id: int | None = None
    return_sampling_logprobs: bool = False
    check_done_every: int = 4
    compile: bool = False  # torch.compile the decode step (see realrl.models.generation)
    # On CUDA (tensor-parallel size 1), replay decode steps captured as CUDA graphs
    # (realrl.models.cuda_graphs); off: the eager or compiled steps of the CPU path.
    cuda_graphs: bool = True

    def validate(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"n={self.n} must be >= 1")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            problems.append(f"min_new_tokens={self.min_new_tokens} must lie in [0, max_new_tokens]")
        if not self.greedy and self.temperature <= 0:
            problems.append(f"temperature={self.temperature} must be > 0 (or set greedy=True)")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0 (0 switches it off)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must lie in (0, 1] (1.0 switches it off)")
        if self.check_done_every < 1:
            problems.append(f"check_done_every={self.check_done_every} must be >= 1")
        if problems:
            raise ValueError("invalid GenerationConfig: " + "; ".join(problems))

    def resolved_stop_ids(self, model_eos_ids: list[int]) -> list[int]:
        eos = [self.eos_token_id] if self.eos_token_id is not None else list(model_eos_ids)
        return list(dict.fromkeys(eos + list(self.stop_token_ids)))


@dataclasses.dataclass
class GenerationOutput:
    """Prompt + response per sequence, packed; sequences grouped by prompt (n per prompt).

    `packed_logprobs` covers response tokens only, packed in sequence order, i.e. it splits
    by `response_lens`; entry j of a sequence is log p(response_j | prompt, response_<j).
    """

    packed_input_ids: torch.Tensor  # [total_tokens]
    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32
    prompt_lens: torch.Tensor  # [num_seqs]
    response_lens: torch.Tensor  # [num_seqs]
    packed_logprobs: torch.Tensor  # [total_response_tokens] fp32
    no_eos: torch.Tensor  # [num_seqs] bool: hit max_new_tokens without EOS/stop
    packed_sampling_logprobs: torch.Tensor | None = None  # [total_response_tokens]


class SamplingRule(NamedTuple):
    """The settings of `GenerationConfig` that shape a sampling distribution (a tuple of
    constants, so that a compiled decode step specialises on them)."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float

    @classmethod
    def of(cls, config: GenerationConfig) -> SamplingRule:
        return cls(config.greedy, config.temperature, config.top_k, config.top_p)

    @property
    def plain(self) -> bool:
        """Sampling from the raw distribution: temperature 1, no top-k, no top-p."""
        return not self.greedy and self.temperature == 1.0 and self.top_k == 0 and self.top_p == 1.0


def sampling_logits(logits: torch.Tensor, rule: SamplingRule, masked: torch.Tensor):
    """logits [rows, vocab] of the distribution actually sampled from; `masked` [vocab] bool
    marks the stop tokens masked out at this step."""
    logits = logits.masked_fill(masked, float("-inf"))
    if rule.greedy:
        return logits
    if rule.temperature != 1.0:
        logits = logits / rule.temperature
    if rule.top_k > 0:
        kth_largest = logits.topk(min(rule.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if rule.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) > rule.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits


# Vocabularies at least this large are sampled in two levels (see `select_tokens`).
TWO_LEVEL_MIN_VOCAB = 1024
_BLOCK = 128


def select_tokens(weights: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from unnormalised probabilities weights [rows, vocab] >= 0 by
    the uniform draws [rows, 1] in [0, 1).

    Inverse-CDF sampling with one uniform per row, cheaper on CPU than Gumbel-max (a random
    number per vocabulary entry) or `multinomial`; the caller draws the uniforms, so the
    selection itself has no random state and compiles into the decode step. A cumulative sum
    over the vocabulary is sequential and the slowest op of a small model's decode step, so
    large vocabularies go in two levels: pick a block of 128 tokens by the cumulative sum of
    block sums, then a token inside it. The draw is kept strictly below the mass it inverts,
    so a zero-weight token (a masked stop token) is never returned.
    """
    rows, vocab = weights.shape
    if vocab < TWO_LEVEL_MIN_VOCAB or vocab % _BLOCK != 0:
        return _invert(weights, draws).squeeze(1)
    blocks = weights.view(rows, vocab // _BLOCK, _BLOCK)
    block_mass = blocks.sum(-1)  # [rows, blocks]
    cumulative = block_mass.cumsum(-1)
    block = _invert(block_mass, draws, cumulative)  # [rows, 1]
    mass_before = cumulative.gather(1, block) - block_mass.gather(1, block)
    within = blocks.gather(1, block[:, :, None].expand(rows, 1, _BLOCK)).squeeze(1)
    # The draw's remaining mass, as a fraction of the chosen block's own cumulative sum.
    fraction = (draws * cumulative[:, -1:] - mass_before) / block_mass.gather(1, block)
    return (block * _BLOCK + _invert(within, fraction.clamp_(0.0, 1.0))).squeeze(1)


def _invert(weights: torch.Tensor, fractions: torch.Tensor, cumulative=None) -> torch.Tensor:
    """Index [rows, 1] of the first entry whose cumulative weight exceeds fraction * total."""
    if cumulative is None:
        cumulative = weights.cumsum(-1)
    total = cumulative[:, -1:]
    # 1 - 2^-20 keeps the target below the total despite rounding (and a fraction of 1).
    target = torch.minimum(fractions * total, total * (1 - 2**-20))
    # How many cumulative weights are <= target: `searchsorted(right=True)` as one reduction.
    index = (cumulative <= target).sum(-1, keepdim=True)
    return index.clamp_max(weights.shape[-1] - 1)


def choose_tokens(
    logits: torch.Tensor,  # [rows, vocab] raw, fp32
    rule: SamplingRule,
    masked: torch.Tensor,  # [vocab] bool: stop tokens masked out of sampling at this step
    draws: torch.Tensor,  # [rows, 1] uniforms in [0, 1)
    with_sampling_logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Next tokens [rows], their log-probs [rows] under the raw distribution, and (when asked
    for) under the distribution actually sampled from.

    One exp over the vocabulary serves both the raw log-normaliser and, at temperature 1
    without top-k/top-p (the usual RL setting), the sampling weights; masking stop tokens
    then just zeroes their weights. No host syncs and no random state: the compiled decode
    step runs it in its graph.
    """
    max_logit = logits.amax(-1, keepdim=True)
    weights = (logits - max_logit).exp()  # [rows, vocab] unnormalised raw probabilities
    log_normaliser = weights.sum(-1, keepdim=True).log() + max_logit  # logsumexp
    if rule.plain:
        weights = weights.masked_fill(masked, 0.0)
        tokens = select_tokens(weights, draws)
    else:
        modified = sampling_logits(logits, rule, masked)
        # Greedy decoding needs the sampled distribution's weights only to report log-probs.
        if not rule.greedy or with_sampling_logprobs:
            weights = (modified - modified.amax(-1, keepdim=True)).exp()
        tokens = modified.argmax(-1) if rule.greedy else select_tokens(weights, draws)
    chosen = tokens[:, None]
    logprobs = (logits.gather(1, chosen) - log_normaliser).squeeze(1)
    if not with_sampling_logprobs:
        return tokens, logprobs, None
    sampling_logprobs = (weights.gather(1, chosen) / weights.sum(-1, keepdim=True)).log()
    return tokens, logprobs, sampling_logprobs.squeeze(1)


def pack_outputs(
    packed_prompts: torch.Tensor,  # [total_prompt_tokens]
    prompt_lens: torch.Tensor,  # [num_prompts]
    n: int,
    tokens: torch.Tensor,  # [num_seqs, steps]
    logprobs: torch.Tensor,  # [num_seqs, steps]
    sampling_logprobs: torch.Tensor | None,
    response_lens: torch.Tensor,  # [num_seqs]
    finished: torch.Tensor,  # [num_seqs]
) -> GenerationOutput:
    """Cuts each row at its response length and packs prompt + response (one host sync)."""
    prompts = packed_prompts.split(prompt_lens.tolist())
    lengths = response_lens.tolist()
    pieces, logprob_pieces, sampling_pieces = [], [], []
    for row, length in enumerate(lengths):
        pieces.extend([prompts[row // n], tokens[row, :length]])
        logprob_pieces.append(logprobs[row, :length])
        if sampling_logprobs is not None:
            sampling_pieces.append(sampling_logprobs[row, :length])
    row_prompt_lens = prompt_lens.repeat_interleave(n)
    seq_lens = row_prompt_lens + response_lens
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=tokens.device)
    cu_seqlens[1:] = seq_lens.cumsum(0)
    return GenerationOutput(
        packed_input_ids=torch.cat(pieces),
        cu_seqlens=cu_seqlens,
        prompt_lens=row_prompt_lens,
        response_lens=response_lens,
        packed_logprobs=torch.cat(logprob_pieces),
        no_eos=~finished,
        packed_sampling_logprobs=torch.cat(sampling_pieces)
        if sampling_logprobs is not None
        else None,
    )
