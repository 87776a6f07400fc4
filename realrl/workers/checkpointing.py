"""Worker side of checkpoints: weights in Hugging Face format, optimizer, interface and RNG state.

A checkpoint directory holds:
- one HF directory per role whose weights change during a run (trained roles and EMA targets),
  with full weights even when the owner layout is tensor parallel (gathered over the tp group
  of the owner's data-parallel replica 0 and written by its first rank), and the optimizer and
  LR schedule beside them. The torch optimizer backend writes `optimizer.pt`, or with tp size
  T one `optimizer.tp<r>of<T>.pt` per tp rank r (optimizer state is sharded like the
  parameters; data-parallel replicas are equal, so replica 0 writes). The megatron backend's
  distributed optimizer shards its state over the data-parallel group too: every rank of the
  layout writes its own `optimizer.dp<d>of<D>.tp<r>of<T>.pt`, and a resume needs the same
  layout (a missing file names the fix). Loading shards the full weights again for every
  hosted layout. With
  `checkpoint.weights_only=true` only the LR schedule is written (`lr_scheduler.pt`, by the
  first rank); resuming from it keeps the schedule and starts AdamW's moments from zero.
  A language model trained on answers (SFT, DPO) lists the token its answers end with among
  the EOS ids of its generation_config.json (a base model's chat template may close a turn with
  `<|im_end|>` while its config names `<|endoftext|>`), so generation from it stops there;
- for a role with LoRA adapters (`<role>.lora.rank > 0`), the adapter instead of full weights,
  in PEFT's format (`adapter_model.safetensors`, `adapter_config.json`: `realrl.models.
  peft_format`; with a critic's value head), the tokenizer, and with `<role>.lora.save_merged`
  the merged weights as a full HF model in `<role>/merged/`; the optimizer state beside it
  holds the adapters' only. Loading reads the adapter back into every hosted layout (the base
  weights are the run's own, unchanged);
- `interfaces/<mfc>.pt`: the state an interface keeps between steps (`interface.state`: the PPO
  interfaces' KL controller and value normaliser), written by the first rank of the MFC's
  layout; it is the same on every data-parallel rank (its statistics are all-reduced), so every
  rank of the MFC's layout loads it, whatever the layout of the resumed run;
- `rng/rank<N>.pt`: worker N's global torch RNG and the sampling generator of each layout it
  hosts.
Each worker fsyncs the directory's files before it replies (`checkpoint_disk.fsync_tree`); the
master then writes the data position and marks the directory complete; see
`realrl.workers.recovery`. Resuming with a different worker count or layout works but cannot be
bit-identical: the sampling streams of new ranks and layouts start from their seeds (logged).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from realrl.api.experiment import DatasetKind
from realrl.models.checkpoint import load_pretrained, save_pretrained
from realrl.models.config import ModelConfig
from realrl.models.lora import has_adapters, merged_state_dict
from realrl.models.peft_format import load_adapter, save_adapter
from realrl.models.tensor_parallel import shard_state_dict
from realrl.models.tokenizer import TextFormat, resolve_chat_template
from realrl.models.transformer import Transformer, on_meta_device
from realrl.workers.checkpoint_disk import fsync_tree
from realrl.workers.realloc import (
    full_parameter_shapes,
    gather_full_parameters,
    gather_group_ranks,
    moving_parameter_shapes,
)

logger = logging.getLogger(__name__)

SCHEDULE_FILE = "lr_scheduler.pt"


def changing_roles(plan) -> list[str]:
    roles = {role for role, spec in plan.models.items() if spec.trainable}
    roles |= {hook.target_role for _, hook in plan.ema_hooks()}
    return sorted(roles)


def save_worker_state(worker, directory: str) -> None:
    root = Path(directory)
    for role in changing_roles(worker.plan):
        owner = worker.plan.owner_layout(role)
        if owner not in worker.models:
            continue
        if worker.rank in gather_group_ranks(owner):
            _save_role(worker, owner, root / role)
        elif _writes_own_shard(worker.models[owner].engine, worker.plan):
            (root / role).mkdir(parents=True, exist_ok=True)
            engine = worker.models[owner].engine
            torch.save(engine.state_for_checkpoint(), root / role / optimizer_file_name(engine))
    for mfc in worker.plan.mfcs:
        interface = worker.interfaces.get(mfc.name)
        if _has_state(interface) and worker.rank == worker.plan.layout_of(mfc.name).ranks[0]:
            (root / "interfaces").mkdir(parents=True, exist_ok=True)
            torch.save(interface.state.state_dict(), root / "interfaces" / f"{mfc.name}.pt")
    (root / "rng").mkdir(parents=True, exist_ok=True)
    generators = {
        str(layout): hosted.engine.generator.get_state() for layout, hosted in worker.models.items()
    }
    states = {"torch": torch.get_rng_state(), "generators": generators}
    if torch.cuda.is_available():  # the current device's default generator (LoRA dropout)
        states["cuda"] = torch.cuda.get_rng_state()
    torch.save(states, root / "rng" / f"rank{worker.rank}.pt")
    fsync_tree(root)  # this rank's files, before the master may rename the directory complete


def _save_role(worker, owner, role_dir: Path) -> None:
    """Full HF weights (first rank; a LoRA role's adapter instead, `_save_adapter`) and this
    tp rank's optimizer state, from replica 0; with `checkpoint.weights_only` the LR schedule
    instead of the optimizer state."""
    engine = worker.models[owner].engine
    role_dir.mkdir(parents=True, exist_ok=True)
    plan = worker.plan
    if has_adapters(engine.module):
        full = _save_adapter(worker, owner, role_dir)
    else:
        full = gather_full_parameters(engine, owner, worker.rank, worker.groups)
        if full is not None:
            config = config_to_save(engine.module.config, engine.tokenizer, plan.dataset_kind,
                                    plan.dataset.apply_chat_template)
            with on_meta_device():
                model = Transformer(config)
            model.load_state_dict(full, strict=True, assign=True)
            save_pretrained(model, role_dir, tokenizer=engine.tokenizer)
    if engine.optimizer is None:
        if engine.ema_masters:  # a bf16 EMA reference's fp32 masters
            torch.save(engine.state_for_checkpoint(), role_dir / optimizer_file_name(engine))
        return
    if not plan.base.checkpoint.weights_only:
        torch.save(engine.state_for_checkpoint(), role_dir / optimizer_file_name(engine))
    elif full is not None:
        torch.save(engine.lr_scheduler.state_dict(), role_dir / SCHEDULE_FILE)


def _save_adapter(worker, owner, role_dir: Path) -> dict | None:
    """A LoRA role's adapter in PEFT's format and, with `lora.save_merged`, its merged weights
    in `merged/` (first rank of the gather group; the others take part in the gathers).
    Returns the adapter state on the writing rank, None elsewhere."""
    engine = worker.models[owner].engine
    module, spec = engine.module, worker.plan.models[owner.role]
    lora = module.lora_config
    adapter_shapes = moving_parameter_shapes(module)
    if lora.save_merged:
        shapes = full_parameter_shapes(module.config) + adapter_shapes
        full = gather_full_parameters(engine, owner, worker.rank, worker.groups, shapes)
    else:
        full = gather_full_parameters(engine, owner, worker.rank, worker.groups, adapter_shapes)
    if full is None:
        return None
    adapter = {name: full[name] for name, _ in adapter_shapes}
    save_adapter(role_dir, adapter, lora, spec.config.path, module.config.is_critic)
    if engine.tokenizer is not None:
        engine.tokenizer.save_pretrained(str(role_dir))
    if lora.save_merged:
        config = config_to_save(module.config, engine.tokenizer, worker.plan.dataset_kind,
                                worker.plan.dataset.apply_chat_template)
        with on_meta_device():
            model = Transformer(config)
        model.load_state_dict(merged_state_dict(full, module.config, lora), strict=True,
                              assign=True)
        save_pretrained(model, role_dir / "merged", tokenizer=engine.tokenizer)
    return adapter


def config_to_save(
    config: ModelConfig,
    tokenizer,
    dataset_kind: DatasetKind,
    apply_chat_template: bool | None,
) -> ModelConfig:
    """`config`, plus the token the run's answers end with among the EOS ids of a language
    model trained on answers (SFT, DPO: `dataset_kind` sft or paired) when its checkpoint did
    not list it."""
    if config.is_critic or dataset_kind in (DatasetKind.prompt, DatasetKind.chat):
        return config
    chat = resolve_chat_template(apply_chat_template, tokenizer, tokenizer.name_or_path)
    end = TextFormat(tokenizer, chat).end_token_id
    if end is None or end in config.eos_token_ids:
        return config
    logger.info(
        "the answers this model trained on end with token %d (%r), which its checkpoint did "
        "not list as EOS: the saved generation_config.json adds it",
        end,
        tokenizer.convert_ids_to_tokens(end),
    )
    generation_config = {
        **(config.generation_config or {}),
        "eos_token_id": [*config.eos_token_ids, end],
    }
    return dataclasses.replace(config, generation_config=generation_config)


def _writes_own_shard(engine, plan) -> bool:
    """A rank outside replica 0 whose optimizer state differs from replica 0's."""
    return (engine.backend is not None and engine.backend.shards_over_data_parallel
            and not plan.base.checkpoint.weights_only)


def optimizer_file_name(engine) -> str:
    """This rank's optimizer-state file: one per tp rank (torch backend: data-parallel
    replicas hold equal state), or one per dp and tp rank (megatron's distributed optimizer)."""
    parallel = engine.parallel
    if engine.backend is not None and engine.backend.shards_over_data_parallel:
        return (f"optimizer.dp{parallel.dp_rank}of{parallel.dp_size}"
                f".tp{parallel.tp_rank}of{parallel.tp_size}.pt")
    if parallel.tp_size == 1:
        return "optimizer.pt"
    return f"optimizer.tp{parallel.tp_rank}of{parallel.tp_size}.pt"


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
        if engine.shared_weights is not None and engine.parallel.dp_rank > 0:
            continue  # replicas sharing one copy: the first one loads it
        if has_adapters(engine.module):
            _load_adapter(engine, role_dir)
            _load_optimizer_state(engine, role_dir)
            continue
        loaded = load_pretrained(
            role_dir,
            critic=engine.module.config.is_critic,
            dtype=engine.module.dtype,
            device=engine.device,
        ).state_dict()
        parallel = engine.parallel
        if parallel.tp_size > 1:
            loaded = shard_state_dict(
                loaded, parallel.tp_rank, parallel.tp_size, engine.module.config
            )
        for name, target in engine.module.named_parameters():
            target.copy_(loaded[name])
        _load_optimizer_state(engine, role_dir)
    for mfc in worker.plan.mfcs:
        path = root / "interfaces" / f"{mfc.name}.pt"
        if path.is_file() and worker.rank in worker.plan.layout_of(mfc.name).ranks:
            _load_interface_state(worker, mfc, torch.load(path, map_location="cpu",
                                                           weights_only=False))
    _load_rng_state(worker, root / "rng" / f"rank{worker.rank}.pt")


def _load_optimizer_state(engine, role_dir: Path) -> None:
    """After the weights: fp32 masters take them, then the saved optimizer state, the LR
    schedule of a weights-only checkpoint, or a frozen EMA target's fp32 masters."""
    engine.weights_written()  # a bf16 role's fp32 masters take them (saved ones may follow)
    if engine.optimizer is not None and (role_dir / SCHEDULE_FILE).is_file():
        _resume_schedule_only(engine, torch.load(role_dir / SCHEDULE_FILE, map_location="cpu",
                                                 weights_only=False))
    elif engine.optimizer is not None or (role_dir / optimizer_file_name(engine)).is_file():
        engine.load_checkpoint_state(
            # On the engine's own device: saved CUDA tensors would otherwise load onto the GPU
            # index they were saved from, another rank's (or none) once the layout changes.
            torch.load(_optimizer_path(role_dir, engine), map_location=engine.home_device,
                       weights_only=False)
        )


@torch.no_grad()
def _load_adapter(engine, role_dir: Path) -> None:
    """A LoRA role's saved adapter (PEFT format), into this shard's adapter parameters."""
    module = engine.module
    shapes = dict(moving_parameter_shapes(module))
    loaded = load_adapter(role_dir, module.lora_config, shapes, module.dtype, engine.device)
    parallel = engine.parallel
    if parallel.tp_size > 1:
        loaded = shard_state_dict(loaded, parallel.tp_rank, parallel.tp_size, module.config)
    parameters = dict(module.named_parameters())
    for name, tensor in loaded.items():
        parameters[name].copy_(tensor)
    logger.info("loaded the LoRA adapter of %s from %s", role_dir.name, role_dir)


def _resume_schedule_only(engine, schedule: dict) -> None:
    """A weights-only checkpoint: the LR schedule goes on from its step, and the optimizer's
    learning rate with it (loading optimizer state would have set it); AdamW's moments stay
    zero."""
    engine.lr_scheduler.load_state_dict(schedule)
    for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
        group["lr"] = lr


def _optimizer_path(role_dir: Path, engine) -> Path:
    path = role_dir / optimizer_file_name(engine)
    if not path.is_file():
        written = sorted(p.name for p in role_dir.glob("optimizer*.pt"))
        key = "model" if role_dir.name == "default" else role_dir.name  # sft, rw: `model.*`
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint holds optimizer state {written}, written by a "
            f"layout of another size or by another optimizer backend (one file per tp rank: "
            f"torch; per dp and tp rank: megatron); resume with the same data- and "
            f"tensor-parallel sizes for the trained layout of {role_dir.name!r} (see "
            f"allocation_mode in config.yaml) and the same `{key}.optimizer.backend`"
        )
    return path


def _load_rng_state(worker, path: Path) -> None:
    if not path.is_file():
        logger.warning(
            "%s is missing (the checkpoint was written by fewer workers): worker %d "
            "keeps its seeded RNG streams",
            path,
            worker.rank,
        )
        return
    rng = torch.load(path, map_location="cpu", weights_only=False)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])  # this rank's device (`bind_device`)
    for layout, hosted in worker.models.items():
        if str(layout) in rng["generators"]:
            hosted.engine.generator.set_state(rng["generators"][str(layout)])
        else:
            logger.warning(
                "layout %s is new since the checkpoint: its sampling generator "
                "starts from its seed",
                layout,
            )


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
            raise ValueError(
                f"the checkpoint's {mfc.name} has value-normaliser statistics but "
                "this run has ppo.value_norm=false; resume with ppo.value_norm=true"
            )
        normalizer.load_state_dict(state["value_normalizer"])
