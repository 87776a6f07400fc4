"""Worker side of checkpoints: weights in Hugging Face format, optimizer and RNG state.

A checkpoint directory holds one HF directory per role whose weights change during a run
(trained roles and EMA targets), written by the first rank of the role's owner layout, plus
`optimizer.pt` beside the weights and one `rng/rank<N>.pt` per worker. The master writes the
data position and marks the directory complete; see `realrl.workers.recovery`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from realrl.models.checkpoint import load_pretrained, save_pretrained


def changing_roles(plan) -> list[str]:
    roles = {role for role, spec in plan.models.items() if spec.trainable}
    roles |= {hook.target_role for _, hook in plan.ema_hooks()}
    return sorted(roles)


def save_worker_state(worker, directory: str) -> None:
    root = Path(directory)
    for role in changing_roles(worker.plan):
        owner = worker.plan.owner_layout(role)
        if owner in worker.models and worker.rank == owner.ranks[0]:
            engine = worker.models[owner].engine
            save_pretrained(engine.module, root / role, tokenizer=engine.tokenizer)
            if engine.optimizer is not None:
                torch.save(engine.state_for_checkpoint(), root / role / "optimizer.pt")
    (root / "rng").mkdir(parents=True, exist_ok=True)
    generators = {str(layout): hosted.engine.generator.get_state()
                  for layout, hosted in worker.models.items()}
    torch.save({"torch": torch.get_rng_state(), "generators": generators},
               root / "rng" / f"rank{worker.rank}.pt")


@torch.no_grad()
def load_worker_state(worker, directory: str) -> None:
    root = Path(directory)
    for layout, hosted in worker.models.items():
        role_dir = root / layout.role
        if layout.role not in changing_roles(worker.plan):
            continue
        engine = hosted.engine
        loaded = load_pretrained(role_dir, critic=engine.module.config.is_critic,
                                 dtype=engine.module.dtype, device=engine.device)
        for target, source in zip(engine.module.parameters(), loaded.parameters(), strict=True):
            target.copy_(source)
        if engine.optimizer is not None:
            engine.load_checkpoint_state(torch.load(role_dir / "optimizer.pt", weights_only=False))
    rng = torch.load(root / "rng" / f"rank{worker.rank}.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    for layout, hosted in worker.models.items():
        hosted.engine.generator.set_state(rng["generators"][str(layout)])
