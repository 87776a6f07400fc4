"""Packed-sequence transformer (Llama / Qwen2 / Qwen3 / Mistral families), HF checkpoints, generation.

Submodules: `config` (ModelConfig), `families` (HF config and weight-name mapping),
`transformer` (the model), `attention` (packed attention kernels), `lm_head` (the LM head
fused with the log-softmax: log-probs and entropies by chunks of rows), `checkpoint`
(load_pretrained / save_pretrained), `generation` + `sampling` (KV-cache sampling),
`tensor_parallel` (how tensor parallelism splits each weight: state-dict sharding),
`megatron_layers` (the tensor-parallel layers, from megatron-core) and `tokenizer` (both
imported on their own: they pull in megatron-core and transformers).
"""

from realrl.models.checkpoint import CheckpointError, load_pretrained, save_pretrained
from realrl.models.config import ModelConfig
from realrl.models.families import from_hf_state_dict, get_family, to_hf_state_dict
from realrl.models.generation import GenerationConfig, GenerationOutput, generate
from realrl.models.transformer import Transformer

__all__ = [
    "CheckpointError",
    "GenerationConfig",
    "GenerationOutput",
    "ModelConfig",
    "Transformer",
    "from_hf_state_dict",
    "generate",
    "get_family",
    "load_pretrained",
    "save_pretrained",
    "to_hf_state_dict",
]
