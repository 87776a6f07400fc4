"""The PPO value model: per-token values (``critic_inf``) and the clipped value regression
(``critic_train``).

The critic computes the same rewards, advantages and returns as the actor from the same
rollouts (`realrl.interfaces.ppo_batch.prepare_ppo_batch`), then regresses its values on the
returns with the clipped loss of the PPO2 reference implementation (Engstrom et al. 2020,
section 3). With ``ppo.value_norm`` the model predicts *normalised* values: `values` from
``critic_inf`` are in that space, denormalised before GAE with running statistics that this
interface (and the actor, identically) keeps.
"""

from __future__ import annotations

import logging

import torch

from realrl.algo.aggregation import aggregate_loss, loss_normaliser
from realrl.algo.layout import shifted_values
from realrl.algo.losses import value_loss
from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.interfaces.base import MFCResult
from realrl.interfaces.common import (
    keeps_forward,
    map_microbatches,
    optimizer_step_stats,
    require_engine,
    require_keys,
    strided_minibatches,
    unsupported_call,
)
from realrl.interfaces.configs import PPOCriticConfig
from realrl.interfaces.ppo_batch import PPOTrainingState, prepare_ppo_batch

logger = logging.getLogger(__name__)


class PPOCriticInterface:
    def __init__(self, config: PPOCriticConfig) -> None:
        self.config = config
        self.ppo = config.ppo
        # PPOCriticConfig may carry the generation settings (for overlong shaping and the
        # seq-mean-token-sum-norm length); without them those features are unavailable here.
        generation = getattr(config, "generation", None)
        self.max_new_tokens = None if generation is None else generation.max_new_tokens
        self.state = PPOTrainingState(config.ppo, self.max_new_tokens)

    def optimizer_steps_per_call(self) -> int:
        return self.ppo.num_epochs * self.ppo.num_minibatches

    def inference(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """``values`` float32 ``[total_tokens]``: the value of the prefix ending at each token.

        When critic_train runs on this engine and takes one optimizer step on the same batch
        (`PPOHyperparameters.reuses_forward`), this is its training forward: the engine keeps
        the graph and critic_train starts at the loss."""
        engine = require_engine(engine, "ppo_critic", "inference")
        require_keys(data, ("packed_input_ids",), "ppo_critic.inference")
        keep = keeps_forward(engine, self.ppo, data, microbatch)

        def compute(part: SequenceSample) -> SequenceSample:
            packed_input_ids = part.data["packed_input_ids"].to(engine.device)
            cu_seqlens = part.cu_seqlens("packed_input_ids").to(engine.device)
            values = engine.forward(packed_input_ids, cu_seqlens, keep)  # [total_tokens] fp32
            return SequenceSample.from_tensors(
                ids=part.ids,
                seqlens={"values": part.seqlens["packed_input_ids"]},
                data={"values": values.float().cpu()},
            )

        return MFCResult(data=map_microbatches(data, microbatch, compute))

    def train_step(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        engine = require_engine(engine, "ppo_critic", "train_step")
        require_keys(data, ("values",), "ppo_critic.train_step")
        group = engine.parallel.dp_group
        prepared, means = prepare_ppo_batch(self.state, data, group)
        prepared = prepared.to(engine.device)
        mode, norm_length = self._aggregation()
        step_stats = []
        for _ in range(self.ppo.num_epochs):
            for minibatch in strided_minibatches(prepared, self.ppo.num_minibatches):
                normaliser = loss_normaliser(
                    mode,
                    minibatch.data["loss_mask"],
                    minibatch.cu_seqlens("packed_input_ids"),
                    process_group=group,
                    norm_length=norm_length,
                )
                microbatches, _, _ = minibatch.split_microbatches(
                    microbatch.max_tokens_per_microbatch, microbatch.min_num_microbatches
                )

                def loss_fn(forward, part, normaliser=normaliser):
                    return self._loss(forward, part, normaliser, mode)

                step_stats.append(engine.train_microbatches(microbatches, loss_fn))
        num_steps = len(step_stats)
        for stats in step_stats:
            means.add_global_total("value_loss", stats["value_loss"], num_steps)
            for name in ("value_clip_fraction", "value_mean", "returns_mean"):
                means.add(name, stats[name], stats["num_tokens"])
        result = means.reduce(group)
        result.update(optimizer_step_stats(step_stats))
        result.update(self.state.update_kl_controller(result))
        return MFCResult(stats=result)

    def _aggregation(self) -> tuple[str, int | None]:
        """``ppo.loss_agg_mode`` for the value loss. Without a constant length the
        ``seq-mean-token-sum-norm`` mode becomes ``seq-mean-token-sum``: they differ by the
        constant factor 1 / max_new_tokens, i.e. only by the learning rate."""
        mode = getattr(self.ppo.loss_agg_mode, "value", self.ppo.loss_agg_mode)
        norm_length = self.ppo.loss_agg_norm_length or self.max_new_tokens
        if mode == "seq-mean-token-sum-norm" and norm_length is None:
            return "seq-mean-token-sum", None
        return mode, norm_length

    def _loss(self, forward, part: SequenceSample, normaliser: torch.Tensor, mode: str):
        packed_input_ids = part.data["packed_input_ids"]  # [total_tokens]
        cu_seqlens = part.cu_seqlens("packed_input_ids")  # [num_seqs + 1]
        loss_mask = part.data["loss_mask"]  # [total_tokens - num_seqs]
        values = shifted_values(forward(packed_input_ids, cu_seqlens), cu_seqlens)
        old_values = shifted_values(part.data["values"], cu_seqlens)
        output = value_loss(
            values, old_values, part.data["returns"], loss_mask, self.ppo.value_eps_clip
        )
        loss = aggregate_loss(output.per_token_loss, loss_mask, cu_seqlens, mode, normaliser)
        num_tokens = output.stats["num_tokens"]
        stats = {
            "value_loss": loss.detach(),
            "num_tokens": num_tokens,
            "value_clip_fraction": output.stats["value_clip_fraction"] * num_tokens,
            "value_mean": output.stats["value_mean"] * num_tokens,
            "returns_mean": output.stats["returns_mean"] * num_tokens,
        }
        return loss, stats

    def generate(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        raise unsupported_call("ppo_critic", "generate", "inference and train_step")
