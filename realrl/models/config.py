"""The architecture description shared by every model family.

`ModelConfig` is the one dataclass the packed transformer is built from. Families
(`realrl.models.families`) translate a Hugging Face `config.json` into it and back, so the
model code never reads HF-specific keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass
class ModelConfig:
    """Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

    `head_dim` defaults to `hidden_size // num_attention_heads`. `rope_scaling` holds the HF
    `rope_parameters`/`rope_scaling` dict minus `rope_theta` (e.g. `{"rope_type": "llama3",
    "factor": 8.0, ...}`), or None for plain RoPE. `sliding_window` (Mistral) limits how far
    back a token attends; None means full causal attention. `qk_norm` (Qwen3) RMS-normalises
    each head's query and key over head_dim before the rotation.

    `eos_token_id` is config.json's; `generation_config` is the checkpoint's
    generation_config.json as loaded (None without one), carried into every checkpoint realrl
    saves. Its `eos_token_id` may list more ids than config.json (Qwen2.5-Instruct:
    config.json 151645, generation_config.json [151645, 151643]); `eos_token_ids` is the union.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of each head's query and key
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    is_critic: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    generation_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        problems = []
        if self.num_attention_heads % self.num_key_value_heads != 0:
            problems.append(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2 != 0:
            problems.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            problems.append(
                f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def num_query_groups(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a response: config.json's, then generation_config.json's."""
        return merged_eos_token_ids(self.eos_token_id, self.generation_config)


def merged_eos_token_ids(
    config_eos: int | list[int] | None, generation_config: dict[str, Any] | None
) -> list[int]:
    """The union of config.json's `eos_token_id` and generation_config.json's, in that order."""
    generation_eos = (generation_config or {}).get("eos_token_id")
    return list(dict.fromkeys(token_id_list(config_eos) + token_id_list(generation_eos)))


def token_id_list(value: int | list[int] | None) -> list[int]:
    """An HF `*_token_id` entry (an int, a list of ints, or null) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(token_id) for token_id in value]
