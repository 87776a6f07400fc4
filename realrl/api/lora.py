"""LoRA adapters of a model role (`<role>.lora.*`; Hu et al. 2021, "LoRA: Low-Rank Adaptation").

A role with `lora.rank > 0` keeps its checkpoint's weights frozen and trains, beside each
targeted projection W [out, in], two factors A [rank, in] and B [out, rank]: the layer computes
`W x + (alpha / rank) * B A dropout(x)`, with B zero at the start (so the adapted model starts
equal to its base) and A drawn like PEFT's (Kaiming-uniform). Only the factors (and a critic's
value head, which is new) train and carry optimizer state; the model code is
`realrl.models.lora`, checkpoints are PEFT's format (`realrl.models.peft_format`).

This module holds the config section and the checks that need the run's allocations
(`lora_plan_problems`, run by `--dry-run` and every launch): which combinations realrl runs
and, where it does not, why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from realrl.api.config import InertKeys, help_field, value_text

if TYPE_CHECKING:
    from realrl.api.allocation import MFCAllocation
    from realrl.api.dfg import DataflowGraph
    from realrl.api.experiment import ExperimentSpec

# Hugging Face's names of the Llama-family projections an adapter may target, in layer order.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_TARGETS + MLP_TARGETS


@dataclass
class LoRAConfig:
    rank: int | None = help_field(
        0, "LoRA rank r (Hu et al. 2021). 0 or null: no adapters, every weight trains. r > 0: "
        "the checkpoint's weights stay frozen and each projection in `target_modules` gets "
        "factors A [r, in] and B [out, r] (B starts at zero) that alone train, with AdamW "
        "state for them only (and a critic's value head); checkpoints hold the adapter in "
        "PEFT's format (adapter_model.safetensors, adapter_config.json). In ppo-math an "
        "actor with adapters is also the reference: `ref_inf` runs the actor's base with the "
        "adapter off, so the reference holds no weights of its own."
    )
    alpha: float | None = help_field(
        None, "The adapter's output is scaled by alpha / rank; null: 2 x rank (scale 2)."
    )
    dropout: float = help_field(
        0.0, "Dropout on the adapter's input in training forwards (PEFT's lora_dropout); the "
        "base path and generation never drop. > 0 is refused with tensor parallelism (the "
        "ranks of a column-parallel layer would drop different inputs) and with "
        "gradient_checkpointing (the recomputation would drop others than the forward)."
    )
    target_modules: list[str] = help_field(
        list(TARGET_MODULES), "Projections that get an adapter, by their Hugging Face names: "
        "any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (default all, "
        "as LlamaFactory's `all`)."
    )
    save_merged: bool = help_field(
        False, "Checkpoints also write the merged weights (W + alpha / rank x B A) as a full "
        "Hugging Face model in `<role>/merged/`, loadable without PEFT (a full model's bytes "
        "per checkpoint)."
    )

    @property
    def enabled(self) -> bool:
        return bool(self.rank)

    @property
    def resolved_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * (self.rank or 0)

    @property
    def scaling(self) -> float:
        return self.resolved_alpha / self.rank if self.rank else 0.0

    def inert_keys(self, prefix: str) -> list[InertKeys]:
        if self.enabled:
            return []
        return [InertKeys(tuple(f"{prefix}.{name}" for name in ("alpha", "dropout",
                                                                "target_modules", "save_merged")),
                          f"with `{prefix}.rank={value_text(self.rank)}` (no adapter)",
                          f"set {prefix}.rank > 0")]

    def validate(self, prefix: str) -> list[str]:
        problems = []
        if self.rank is not None and self.rank < 0:
            problems.append(f"`{prefix}.rank={self.rank}` must be >= 1, or 0/null for no "
                            "adapters.")
        if self.alpha is not None and self.alpha <= 0:
            problems.append(f"`{prefix}.alpha={self.alpha}` must be > 0, or null for 2 x rank.")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"`{prefix}.dropout={self.dropout}` must be in [0, 1).")
        unknown = [name for name in self.target_modules if name not in TARGET_MODULES]
        if unknown:
            problems.append(f"`{prefix}.target_modules` names {unknown}, which are not "
                            f"projections of the supported families; choose from "
                            f"{list(TARGET_MODULES)}.")
        repeated = sorted({name for name in self.target_modules
                           if self.target_modules.count(name) > 1})
        if repeated:
            problems.append(f"`{prefix}.target_modules` names {repeated} more than once.")
        if self.enabled and not self.target_modules:
            problems.append(f"`{prefix}.target_modules=[]` targets nothing: name at least one "
                            f"of {list(TARGET_MODULES)}, or set `{prefix}.rank=0`.")
        return problems


def role_lora_problems(role: Any, prefix: str) -> list[str]:
    """What `<prefix>.lora` cannot run with among the role's other keys (`role`: a
    `ModelRoleConfig`)."""
    lora: LoRAConfig = role.lora
    problems = lora.validate(f"{prefix}.lora")
    if not lora.enabled:
        return problems
    key = f"`{prefix}.lora.rank={lora.rank}`"
    if role.compile:
        problems.append(f"{key} with `{prefix}.compile=true`: the compiled transformer blocks "
                        "read the projections' weights directly and would skip the adapters; "
                        f"set `{prefix}.compile=false` (the decode step's `gen.compile` works).")
    if role.sequence_parallel:
        problems.append(f"{key} with `{prefix}.sequence_parallel=true`: the adapters do not "
                        "gather a token-split input as megatron's sequence-parallel layers do; "
                        f"set `{prefix}.sequence_parallel=false`.")
    if lora.dropout > 0 and role.gradient_checkpointing:
        problems.append(f"`{prefix}.lora.dropout={lora.dropout}` with "
                        f"`{prefix}.gradient_checkpointing=true`: the backward's recomputation "
                        "would draw other dropout masks than the forward; set one of them off.")
    return problems


def lora_plan_problems(spec: ExperimentSpec, graph: DataflowGraph,
                       allocations: dict[str, MFCAllocation]) -> list[str]:
    """Adapter settings the run's layouts cannot run, each with the fix: a frozen role with
    adapters of its own, dropout under tensor parallelism, and a role that shares another's
    base weights (`ModelSpec.shares_base_with`) on ranks that hold no layout of that role with
    the same tensor-parallel slicing."""
    problems = []
    for role, model in spec.models.items():
        if model.config is None or model.kind.value == "rule":  # a verifier: no weights
            continue
        lora = model.config.lora
        mfcs = [name for name, mfc in graph.mfcs.items() if mfc.model_role == role]
        if lora.enabled and not model.trainable and model.shares_base_with is None:
            key = model.config_key("lora.rank")
            problems.append(f"`{key}={lora.rank}`: this role does not train, and its "
                            f"adapters would stay zero; set `{key}=0`.")
        tensor_parallel = [name for name in mfcs if allocations[name].strategy.tensor > 1]
        if lora.enabled and lora.dropout > 0 and tensor_parallel:
            key = model.config_key("lora.dropout")
            problems.append(f"`{key}={lora.dropout}` with tensor parallelism "
                            f"({', '.join(f'{n}:{allocations[n].strategy}' for n in tensor_parallel)}): "
                            "the tp ranks of a column-parallel layer would drop different "
                            f"inputs; set `{key}=0` or give the role's MFCs t1 layouts.")
        if model.shares_base_with is not None:
            problems += _shared_base_problems(spec, graph, allocations, role)
    return problems


def _shared_base_problems(spec: ExperimentSpec, graph: DataflowGraph,
                          allocations: dict[str, MFCAllocation], role: str) -> list[str]:
    """Every rank of the sharing role's MFCs must also hold a layout of the base's role with
    the same tensor-parallel size and coordinate: that layout's weights are the base."""
    base_role = spec.models[role].shares_base_with
    base_mfcs = [name for name, mfc in graph.mfcs.items() if mfc.model_role == base_role]
    slicing = {(rank, allocations[name].strategy.tensor,
                allocations[name].coordinates_of(rank).tp)
               for name in base_mfcs for rank in allocations[name].mesh.ranks}
    problems = []
    for name, mfc in graph.mfcs.items():
        if mfc.model_role != role:
            continue
        allocation = allocations[name]
        missing = [rank for rank in allocation.mesh.ranks
                   if (rank, allocation.strategy.tensor,
                       allocation.coordinates_of(rank).tp) not in slicing]
        if missing:
            layouts = ", ".join(f"{n}:{allocations[n].strategy}@{list(allocations[n].mesh.ranks)}"
                                for n in base_mfcs)
            problems.append(
                f"role {role!r} is {base_role!r}'s base weights with its adapter off (no copy "
                f"of its own), so every rank of MFC `{name}` ({allocation.strategy} on ranks "
                f"{list(allocation.mesh.ranks)}) must hold a {base_role!r} layout with the same "
                f"tensor-parallel size, and rank(s) {missing} hold none ({base_role}'s layouts: "
                f"{layouts}); give `{name}` the layout of one of them in `allocation_mode`, "
                "or allocation_mode=auto")
    return problems
