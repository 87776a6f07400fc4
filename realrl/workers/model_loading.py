"""Build a model worker's engine for one model role from its checkpoint directory."""

from __future__ import annotations

import torch

from realrl.api.experiment import ModelKind, ModelSpec
from realrl.backends.torch_engine import ParallelContext, TorchEngine
from realrl.models.checkpoint import load_pretrained
from realrl.models.tokenizer import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_engine(spec: ModelSpec, parallel: ParallelContext, trains: bool,
                total_optimizer_steps: int, seed: int) -> TorchEngine:
    """Load `spec`'s weights (the launcher has resolved every path) and wrap them in an engine
    with an optimizer when this layout trains the role."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    module = load_pretrained(spec.config.path, critic=spec.kind == ModelKind.critic,
                             dtype=DTYPES[spec.config.dtype.value], device=device)
    tokenizer = load_tokenizer(spec.config.path)
    engine = TorchEngine(module, tokenizer, parallel,
                         optimizer_config=spec.config.optimizer if trains else None,
                         total_optimizer_steps=total_optimizer_steps, seed=seed)
    return engine
