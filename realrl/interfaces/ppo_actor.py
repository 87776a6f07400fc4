"""The PPO-family policy: rollouts (``actor_gen``) and the clipped-surrogate update (``actor_train``).

One ``train_step`` follows the recipe of Schulman et al. 2017 with the LLM details of
Ouyang et al. 2022 and the estimator chosen by ``ppo.adv_estimator``:

1. task rewards are shaped (`realrl.interfaces.ppo_batch.prepare_ppo_batch`), spread over
   tokens with the KL penalty, and turned into advantages, whitened over the data-parallel
   group;
2. ``num_epochs`` x ``num_minibatches`` optimizer steps, each over a strided mini-batch of
   this rank's samples; the loss denominator of every step is global (all micro-batches,
   all ranks, `realrl.algo.aggregation`), so the engine's summed gradients equal one process
   training on the whole batch.

The PPO ratio's denominator is the generation's log-probs (the behaviour policy), or with
``ppo.decoupled_loss`` the proximal policy's (the weights before this call's update), each token
then weighted by its capped ``pi_prox / pi_behav`` (`realrl.algo.offpolicy`).
"""

from __future__ import annotations

import logging
import time

import torch

from realrl.algo.aggregation import aggregate_loss, loss_normaliser
from realrl.algo.kl import kl_estimate
from realrl.algo.layout import response_mask
from realrl.algo.losses import (
    cispo_policy_loss,
    entropy_bonus_loss,
    gspo_policy_loss,
    ppo_policy_loss,
)
from realrl.algo.offpolicy import behaviour_importance_weights, interpolated_proximal_logprobs
from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.episodes.rollout import EpisodeRollout
from realrl.interfaces.base import MFCResult
from realrl.interfaces.chunked_generation import ChunkedGenerations, ChunkRequest
from realrl.interfaces.common import (
    DistributedMeans,
    generate_with_backend,
    keeps_forward,
    loss_mask_from_prompt_mask,
    optimizer_step_stats,
    require_engine,
    require_keys,
    sampling_config,
    shifted_logprobs,
    shifted_seqlens,
    strided_minibatches,
)
from realrl.interfaces.configs import PPOActorConfig
from realrl.interfaces.ppo_batch import PPOTrainingState, prepare_ppo_batch

logger = logging.getLogger(__name__)


class PPOActorInterface:
    def __init__(self, config: PPOActorConfig) -> None:
        if config.generation_size < config.group_size:
            raise ValueError(
                f"generation_size={config.generation_size} must be >= group_size="
                f"{config.group_size}"
            )
        self.config = config
        self.ppo = config.ppo
        self.state = PPOTrainingState(config.ppo, config.generation.max_new_tokens)
        # seq-mean-token-sum-norm's constant length: ppo.loss_agg_norm_length or max_new_tokens.
        self.norm_length = config.ppo.loss_agg_norm_length or config.generation.max_new_tokens
        self._warned_best_of_n = False
        self.chunked = ChunkedGenerations()  # generations in flight, by session
        self._episodes: EpisodeRollout | None = None  # built on the first episode rollout

    def optimizer_steps_per_call(self) -> int:
        return self.ppo.num_epochs * self.ppo.num_minibatches

    # ------------------------------------------------------------------ actor_gen
    def generate(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """``generation_size`` responses per prompt; the first ``group_size`` are kept.

        Keeping the best of n needs rewards, which only exist after ``rew_inf``; until the graph
        supports that, the extra responses are dropped (logged once).
        """
        engine = require_engine(engine, "ppo_actor", "generate")
        config = self.config
        if config.generation_size > config.group_size and not self._warned_best_of_n:
            logger.warning(
                "generation_size=%d > group_size=%d: best-of-n selection needs rewards, which "
                "come after generation; keeping the first %d responses of each prompt",
                config.generation_size,
                config.group_size,
                config.group_size,
            )
            self._warned_best_of_n = True
        if config.episode.enabled:
            return self._episode_rollout(engine, data)
        started = time.perf_counter()
        output = generate_with_backend(
            engine,
            config.generation,
            data.data["packed_prompts"],
            data.cu_seqlens("packed_prompts"),
            sampling_config(config.generation, config.generation_size, engine),
        )
        return self._rollout_result(data, output, time.perf_counter() - started)

    def generate_chunk(self, engine, data: SequenceSample | None, microbatch: MicroBatchSpec,
                       request: ChunkRequest) -> MFCResult | None:
        """``generate`` in chunks of decode steps, new weights allowed between two
        (`realrl.interfaces.chunked_generation`): None until the last chunk, whose rollout also
        holds ``packed_weight_versions``, the version of the weights that chose each token."""
        engine = require_engine(engine, "ppo_actor", "generate")
        config = self.config
        if config.episode.enabled:
            return self._episode_chunk(engine, data, request)
        finished = self.chunked.run(
            engine.module, data, request,
            lambda: sampling_config(config.generation, config.generation_size, engine),
            engine.generator)
        if finished is None:
            return None
        output, versions = finished.generation.output()
        result = self._rollout_result(finished.prompts, output, finished.compute_s, versions)
        result.stats["weight_updates"] = float(finished.generation.weight_updates)
        return result

    def _episode_chunk(self, engine, data: SequenceSample | None,
                       request: ChunkRequest) -> MFCResult:
        """Episodes are not interruptible: the first chunk runs them whole, on one weight
        version, which every model token records (-1 where the next token is not the model's,
        as in ``_rollout_sample``)."""
        if data is None:
            raise ValueError(
                f"chunked generation: episode session {request.session!r} already finished on "
                "this worker (episodes run whole in their first chunk)")
        result = self._episode_rollout(engine, data)
        rollout = result.data
        model_next = loss_mask_from_prompt_mask(rollout.data["prompt_mask"],
                                                rollout.cu_seqlens("prompt_mask"))
        versions = torch.where(model_next, request.version, -1).long()
        rollout.update_(SequenceSample.from_tensors(
            ids=rollout.ids, seqlens={"packed_weight_versions": rollout.seqlens["packed_logprobs"]},
            data={"packed_weight_versions": versions}))
        result.stats["weight_updates"] = 0.0
        return result

    def _rollout_result(self, data: SequenceSample, output, elapsed_s: float,
                        versions: torch.Tensor | None = None) -> MFCResult:
        config = self.config
        rollout = _rollout_sample(data, output, config.generation_size, config.group_size,
                                  versions)
        response_lens = output.response_lens.float()
        stats = {
            "response_length": float(response_lens.mean()),
            "no_eos_fraction": float(output.no_eos.float().mean()),
            "generated_tokens_per_s": float(response_lens.sum()) / max(elapsed_s, 1e-9),
        }
        return MFCResult(data=rollout, stats=stats)

    def _episode_rollout(self, engine, data: SequenceSample) -> MFCResult:
        """``episode.name`` set: one multi-turn episode per response (`realrl.episodes`)."""
        config = self.config
        if self._episodes is None:
            self._episodes = EpisodeRollout(config.episode, config.apply_chat_template,
                                            engine.tokenizer)
        sampling = sampling_config(config.generation, 1, engine)
        rollout, stats = self._episodes.run(engine, data, sampling, config.generation_size,
                                            config.group_size)
        return MFCResult(data=rollout, stats=stats)

    # ------------------------------------------------------------------ inference
    def inference(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """Recompute ``packed_logprobs`` (shifted, temperature 1) with the current weights."""
        engine = require_engine(engine, "ppo_actor", "inference")
        return MFCResult(data=shifted_logprobs(engine, data, microbatch, "packed_logprobs"))

    # ------------------------------------------------------------------ actor_train
    def train_forward(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        """``actor_train``'s forward on the rollout alone, sent by the master while the
        reference and the critic compute (``MFCDef.forward_keys``); the engine keeps it and
        `train_step` starts at the loss. A batch that would train in several micro-batches
        keeps nothing (that would hold all their activations at once)."""
        engine = require_engine(engine, "ppo_actor", "train_step")
        require_keys(data, ("packed_input_ids",), "ppo_actor.train_forward")
        if keeps_forward(engine, self.ppo, data, microbatch):
            engine.forward(data.data["packed_input_ids"], data.cu_seqlens("packed_input_ids"),
                           keep=True)
        return MFCResult()

    def train_step(self, engine, data: SequenceSample, microbatch: MicroBatchSpec) -> MFCResult:
        engine = require_engine(engine, "ppo_actor", "train_step")
        group = engine.parallel.dp_group
        prepared, means = prepare_ppo_batch(self.state, data, group)
        if self._needs_proximal_forward():
            prepared.update_(shifted_logprobs(engine, prepared, microbatch, "proximal_logprobs"))
        prepared = prepared.to(engine.device)
        ppo, mode = self.ppo, _enum_value(self.ppo.loss_agg_mode)
        step_stats: list[dict] = []
        for _ in range(ppo.num_epochs):
            for minibatch in strided_minibatches(prepared, ppo.num_minibatches):
                normaliser = loss_normaliser(
                    mode,
                    minibatch.data["loss_mask"],
                    minibatch.cu_seqlens("packed_input_ids"),
                    process_group=group,
                    norm_length=self.norm_length,
                )
                microbatches, _, _ = minibatch.split_microbatches(
                    microbatch.max_tokens_per_microbatch, microbatch.min_num_microbatches
                )

                def loss_fn(forward, part, normaliser=normaliser):
                    return self._loss(engine.module, forward, part, normaliser, mode)

                step_stats.append(engine.train_microbatches(microbatches, loss_fn))
        stats = _reduce_train_stats(step_stats, means, group, ppo.decoupled_loss)
        stats.update(self.state.update_kl_controller(stats))
        return MFCResult(stats=stats)

    def _needs_proximal_forward(self) -> bool:
        """The decoupled loss's proximal log-probs need their own forward only when the call
        takes several optimizer steps: later steps' forwards run on updated weights."""
        ppo = self.ppo
        return (
            ppo.decoupled_loss
            and ppo.prox_logp == "forward"
            and self.optimizer_steps_per_call() > 1
        )

    def _loss(self, model, forward, part: SequenceSample, normaliser: torch.Tensor, mode: str):
        """This micro-batch's share of the mini-batch loss, and its statistics as sums. `model`
        reads log-probs and entropies off its final hidden states, computing the LM head chunk
        by chunk (`realrl.models.lm_head`)."""
        ppo = self.ppo
        packed_input_ids = part.data["packed_input_ids"]  # [total_tokens]
        cu_seqlens = part.cu_seqlens("packed_input_ids")  # [num_seqs + 1]
        loss_mask = part.data["loss_mask"]  # [total_tokens - num_seqs]
        hidden = forward(packed_input_ids, cu_seqlens)  # [total_tokens, hidden]
        # [total_tokens - num_seqs] each, from one pass over the logits' chunks.
        logprobs, entropy = model.shifted_logprobs_and_entropy(hidden, packed_input_ids, cu_seqlens)
        if ppo.entropy_coef == 0.0:
            entropy = entropy.detach()  # only logged: its backward is skipped
        policy, behaviour = self._policy_loss(logprobs, part)
        per_token = policy.per_token_loss + entropy_bonus_loss(entropy, loss_mask, ppo.entropy_coef)
        kl_loss = torch.zeros_like(logprobs)
        if ppo.use_kl_loss and "ref_logprobs" in part.keys:
            estimator = _enum_value(ppo.kl_estimator)
            kl_loss = kl_estimate(logprobs, part.data["ref_logprobs"], estimator, ppo.kl_clamp)
            per_token = per_token + self.state.kl_coef * kl_loss
        per_token = per_token * (1.0 - policy.stats["early_stopped"])
        loss = aggregate_loss(per_token, loss_mask, cu_seqlens, mode, normaliser)
        policy_share = aggregate_loss(
            policy.per_token_loss, loss_mask, cu_seqlens, mode, normaliser
        )
        mask = loss_mask.float()
        num_tokens = policy.stats["num_tokens"]
        stats = {
            "loss": loss.detach(),
            "policy_loss": policy_share.detach(),
            "num_tokens": num_tokens,
            "clip_tokens": policy.stats["clip_fraction"] * num_tokens,
            "dual_clip_tokens": policy.stats["dual_clip_fraction"] * num_tokens,
            "approx_kl_sum": policy.stats["approx_kl"] * num_tokens,
            "ratio_sum": policy.stats["ratio_mean"] * num_tokens,
            "entropy_sum": (entropy.detach() * mask).sum(),
            "kl_loss_sum": (kl_loss.detach() * mask).sum(),
            "early_stopped": policy.stats["early_stopped"],
        }
        if behaviour is not None:
            for name, reported in _BEHAVIOUR_STATS.items():
                stats[f"{reported}_sum"] = behaviour.stats[name] * num_tokens
        return loss, stats

    def _policy_loss(self, logprobs: torch.Tensor, part: SequenceSample):
        """The policy loss per token (``ppo.policy_loss``: PPO's clipped surrogate of each
        token's ratio, GSPO's of its sequence's, or CISPO's truncated weight), against the
        behaviour policy (``old_logprobs``, the generation's log-probs), or with
        ``ppo.decoupled_loss`` against the proximal policy, times the capped behaviour weight
        (`realrl.algo.offpolicy`; None otherwise)."""
        ppo = self.ppo
        loss_mask = part.data["loss_mask"]  # [total_tokens - num_seqs]
        old_logprobs = part.data["old_logprobs"]  # [total_tokens - num_seqs] behaviour
        behaviour = None
        if ppo.decoupled_loss:
            proximal = _proximal_logprobs(ppo.prox_logp, logprobs, part)
            behaviour = behaviour_importance_weights(
                proximal,
                old_logprobs,
                loss_mask,
                part.cu_seqlens("packed_input_ids"),
                level=ppo.behav_imp_weight_level,
                mode=ppo.behav_imp_weight_mode,
                cap=ppo.behav_imp_weight_cap,
            )
            old_logprobs = proximal
        weights = None if behaviour is None else behaviour.weights
        if ppo.policy_loss == "gspo":
            policy = gspo_policy_loss(
                logprobs, old_logprobs, part.data["advantages"], loss_mask,
                part.cu_seqlens("packed_input_ids"), eps_clip=ppo.eps_clip,
                eps_clip_high=ppo.eps_clip_high, behaviour_weights=weights)
            return policy, behaviour
        if ppo.policy_loss == "cispo":
            policy = cispo_policy_loss(
                logprobs, old_logprobs, part.data["advantages"], loss_mask,
                eps_clip=ppo.eps_clip, eps_clip_high=ppo.eps_clip_high, behaviour_weights=weights)
            return policy, behaviour
        policy = ppo_policy_loss(
            logprobs,
            old_logprobs,
            part.data["advantages"],
            loss_mask,
            eps_clip=ppo.eps_clip,
            eps_clip_high=ppo.eps_clip_high,
            dual_clip=ppo.dual_clip,
            ratio_early_stop=ppo.ratio_early_stop,
            behaviour_weights=weights,
        )
        return policy, behaviour


def _proximal_logprobs(method: str, logprobs: torch.Tensor, part: SequenceSample) -> torch.Tensor:
    """``log pi_prox [total_tokens - num_seqs]``: the weights before this train call's update.

    ``forward``: `PPOActorInterface.train_step` computed them (``proximal_logprobs``) when the
    call takes several optimizer steps; with one, this training forward runs on exactly those
    weights, so its log-probs, detached, are them. ``interpolate``: AReaL's log-linear
    interpolation by each token's ``policy_lag`` (train steps since its generating weights).
    """
    if method == "interpolate":
        if "policy_lag" not in part.keys:
            raise ValueError(
                "ppo.prox_logp=interpolate needs each token's policy lag (train steps between "
                "the weights that generated it and the trainer's), which only an asynchronous "
                "rollout records (`packed_weight_versions`); use rollout.mode=async or "
                "ppo.prox_logp=forward"
            )
        return interpolated_proximal_logprobs(
            part.data["old_logprobs"], logprobs, part.data["policy_lag"]
        )
    if "proximal_logprobs" in part.keys:
        return part.data["proximal_logprobs"]
    return logprobs.detach()


# Per-token sums returned by `_loss`, reported as means over response tokens.
_TOKEN_SUMS = {
    "clip_tokens": "clip_fraction",
    "dual_clip_tokens": "dual_clip_fraction",
    "approx_kl_sum": "approx_kl",
    "ratio_sum": "importance_ratio",
    "entropy_sum": "entropy",
    "kl_loss_sum": "kl_loss_term",
}
# Statistics of the decoupled loss's behaviour weight (`behaviour_importance_weights`) and the
# names they are reported under, as means over response tokens (`_loss` returns their sums).
_BEHAVIOUR_STATS = {
    "logp_abs_diff": "behav_logp_abs_diff",
    "weight": "behav_imp_weight",
    "capped_fraction": "behav_capped_fraction",
}


def _reduce_train_stats(
    step_stats: list[dict], means: DistributedMeans, group, with_behaviour: bool
) -> dict:
    """Global statistics of a train step: one all-reduce for rollout and loss statistics.

    ``loss``/``policy_loss`` are each rank's share of a step's global loss, so their sum over
    ranks, averaged over the optimizer steps, is the mean mini-batch loss. The optimizer's
    statistics come from `optimizer_step_stats`.
    """
    num_steps = len(step_stats)
    for stats in step_stats:
        for name in ("loss", "policy_loss", "early_stopped"):
            means.add_global_total(name, stats[name], num_steps)
        for name, reported in _TOKEN_SUMS.items():
            means.add(reported, stats[name], stats["num_tokens"])
        if with_behaviour:
            for reported in _BEHAVIOUR_STATS.values():
                means.add(reported, stats[f"{reported}_sum"], stats["num_tokens"])
    result = means.reduce(group)
    result["early_stopped_microbatches"] = result.pop("early_stopped")
    result.update(optimizer_step_stats(step_stats))
    result["optimizer_steps"] = float(num_steps)
    return result


def _enum_value(value) -> str:
    return getattr(value, "value", value)


def _rollout_sample(data: SequenceSample, output, generation_size: int, group_size: int,
                    versions: torch.Tensor | None = None):
    """Pack the generation output as one sample per prompt holding ``group_size`` sequences;
    with `versions` (``[total_response_tokens]``, each token's weight version) also
    ``packed_weight_versions``, shifted like ``packed_logprobs`` and -1 where the next token is
    a prompt token."""
    num_seqs = output.cu_seqlens.numel() - 1
    keep_seq = (torch.arange(num_seqs) % generation_size) < group_size  # [num_seqs]
    seq_lens = (output.cu_seqlens[1:] - output.cu_seqlens[:-1]).long().cpu()  # [num_seqs]
    prompt_lens = output.prompt_lens.long().cpu()
    token_seq = torch.repeat_interleave(torch.arange(num_seqs), seq_lens)  # [total_tokens]
    position = (
        torch.arange(token_seq.numel())
        - torch.nn.functional.pad(seq_lens.cumsum(0), (1, 0))[token_seq]
    )
    packed_input_ids = output.packed_input_ids.cpu()
    prompt_mask = position < prompt_lens[token_seq]  # [total_tokens]
    # Shifted log-probs: 0 where the next token is a prompt token, else the engine's log-prob.
    loss_mask = response_mask(prompt_lens, seq_lens)  # [total_tokens - num_seqs]
    packed_logprobs = torch.zeros(loss_mask.shape, dtype=torch.float32)
    packed_logprobs[loss_mask] = output.packed_logprobs.float().cpu()
    shifted_seq = torch.repeat_interleave(torch.arange(num_seqs), seq_lens - 1)
    kept_lens = seq_lens[keep_seq].tolist()
    seqlens = [kept_lens[i * group_size : (i + 1) * group_size] for i in range(data.bs)]
    shifted = shifted_seqlens(seqlens)
    packed = {
        "packed_input_ids": (seqlens, packed_input_ids[keep_seq[token_seq]].long()),
        "prompt_mask": (seqlens, prompt_mask[keep_seq[token_seq]]),
        "packed_logprobs": (shifted, packed_logprobs[keep_seq[shifted_seq]]),
        "seq_no_eos_mask": ([[1] * group_size for _ in range(data.bs)],
                            output.no_eos.cpu().bool()[keep_seq]),
    }
    if versions is not None:
        packed_versions = torch.full(loss_mask.shape, -1, dtype=torch.long)
        packed_versions[loss_mask] = versions.long().cpu()
        packed["packed_weight_versions"] = (shifted, packed_versions[keep_seq[shifted_seq]])
    return SequenceSample.from_tensors(
        ids=data.ids,
        seqlens={key: lens for key, (lens, _) in packed.items()},
        data={key: tensor for key, (_, tensor) in packed.items()},
        metadata=data.metadata,
    )
