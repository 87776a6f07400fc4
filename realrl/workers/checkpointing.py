"""Worker side of checkpoints: weights in Hugging Face format, optimizer, interface and RNG state.

A checkpoint directory holds:
- one HF directory per role whose weights change during a run (trained roles and EMA targets),
  written by the first rank of the role's owner layout, with `optimizer.pt` (optimizer and LR
  schedule) beside the weights;
- `interfaces/<mfc>.pt`: the state an interface keeps between steps (`interface.state`: the PPO
  interfaces' KL controller and value normaliser), written by the first rank of the MFC's
  layout; it is the same on every data-parallel rank (its statistics are all-reduced), so every
  rank of the MFC's layout loads it, whatever the layout of the resumed run;
- `rng/rank<N>.pt`: worker N's global torch RNG and the sampling generator of each layout it
  hosts.
The master writes the data position and marks the directory complete; see
`realrl.workers.recovery`. Resuming with a different worker count or layout works but cannot be
bit-identical: the sampling streams of new ranks and layouts start from their seeds (logged).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from realrl.models.checkpoint import load_pretrained, save_pretrained

logger = logging.getLogger(__name__)


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
    for mfc in worker.plan.mfcs:
        interface = worker.interfaces.get(mfc.name)
        if _has_state(interface) and worker.rank == worker.plan.layout_of(mfc.name).ranks[0]:
            (root / "interfaces").mkdir(parents=True, exist_ok=True)
            torch.save(interface.state.state_dict(), root / "interfaces" / f"{mfc.name}.pt")
    (root / "rng").mkdir(parents=True, exist_ok=True)
    generators = {str(layout): hosted.engine.generator.get_state()
                  for layout, hosted in worker.models.items()}
    torch.save({"torch": torch.get_rng_state(), "generators": generators},
               root / "rng" / f"rank{worker.rank}.pt")


def _has_state(interface) -> bool:
    return hasattr(getattr(interface, "state", None), "state_dict")


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
    for mfc in worker.plan.mfcs:
        path = root / "interfaces" / f"{mfc.name}.pt"
        if path.is_file() and worker.rank in worker.plan.layout_of(mfc.name).ranks:
            _load_interface_state(worker, mfc, torch.load(path, weights_only=False))
    _load_rng_state(worker, root / "rng" / f"rank{worker.rank}.pt")


def _load_rng_state(worker, path: Path) -> None:
    if not path.is_file():
        logger.warning("%s is missing (the checkpoint was written by fewer workers): worker %d "
                       "keeps its seeded RNG streams", path, worker.rank)
        return
    rng = torch.load(path, weights_only=False)
    torch.set_rng_state(rng["torch"])
    for layout, hosted in worker.models.items():
        if str(layout) in rng["generators"]:
            hosted.engine.generator.set_state(rng["generators"][str(layout)])
        else:
            logger.warning("layout %s is new since the checkpoint: its sampling generator "
                           "starts from its seed", layout)


def _load_interface_state(worker, mfc, state: dict) -> None:
    """Restore a PPO interface's KL controller and value normaliser (`PPOTrainingState`).

    The normaliser is created lazily by the interface with its layout's data-parallel group,
    so it is created here the same way before its statistics are loaded.
    """
    training_state = worker._interface(mfc).state
    training_state.kl_controller.load_state_dict(state["kl_controller"])
    if "value_normalizer" in state:
        engine = worker.models[worker.plan.layout_of(mfc.name)].engine
        normalizer = training_state.normalizer(engine.parallel.dp_group)
        if normalizer is None:
            raise ValueError(f"the checkpoint's {mfc.name} has value-normaliser statistics but "
                             "this run has ppo.value_norm=false; resume with ppo.value_norm=true")
        normalizer.load_state_dict(state["value_normalizer"])
