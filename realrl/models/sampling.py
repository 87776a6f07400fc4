"""Generation settings, the output record, and the per-step token selection of `generate`."""

from __future__ import annotations

import dataclasses

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


def sampling_logits(
    logits: torch.Tensor, config: GenerationConfig, stop_ids: torch.Tensor, mask_stop: bool
):
    """logits [rows, vocab] of the distribution actually sampled from (a new tensor or `logits`)."""
    if mask_stop and stop_ids.numel() > 0:
        logits = logits.index_fill(1, stop_ids, float("-inf"))
    if config.greedy:
        return logits
    if config.temperature != 1.0:
        logits = logits / config.temperature
    if config.top_k > 0:
        kth_largest = logits.topk(min(config.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) > config.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits


def select_tokens(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row drawn from probs [rows, vocab] by inverting the cumulative sum.

    One uniform per row instead of one per vocabulary entry (Gumbel-max) or `multinomial`:
    on CPU the cumsum + binary search is several times cheaper. `right=True` returns the
    first index whose cumulative mass exceeds the draw, which always has nonzero mass.
    """
    cumulative = probs.cumsum(-1)  # [rows, vocab]
    draws = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device)
    tokens = torch.searchsorted(cumulative, draws * cumulative[:, -1:], right=True)
    return tokens.squeeze(1).clamp_max_(probs.shape[-1] - 1)


def choose_tokens(
    logits: torch.Tensor,  # [rows, vocab] raw, fp32
    logprobs: torch.Tensor,  # [rows, vocab] log_softmax(logits)
    config: GenerationConfig,
    stop_ids: torch.Tensor,
    mask_stop: bool,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [rows] and the (unnormalised) probabilities [rows, vocab] they came from.

    At temperature 1 without top-k/top-p (the usual RL setting) the sampling distribution
    is the raw one, so it reuses `logprobs` instead of a second softmax; EOS masking then
    just zeroes probabilities (the sampler renormalises).
    """
    plain = config.temperature == 1.0 and config.top_k == 0 and config.top_p == 1.0
    if config.greedy or not plain:
        modified = sampling_logits(logits, config, stop_ids, mask_stop)
        probs = modified.softmax(-1)
        tokens = modified.argmax(-1) if config.greedy else select_tokens(probs, generator)
        return tokens, probs
    probs = logprobs.exp()
    if mask_stop and stop_ids.numel() > 0:
        probs.index_fill_(1, stop_ids, 0.0)
    return select_tokens(probs, generator), probs


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
