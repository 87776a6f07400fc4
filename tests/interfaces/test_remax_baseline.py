"""ReMax: the greedy rollout's reward (key `baseline_rewards`, one per prompt) is subtracted from
each sampled response's reward of the same prompt."""

import torch
from interface_helpers import build_model, make_engine, rollout_batch

from realrl.api.rl_config import PPOHyperparameters
from realrl.interfaces.ppo_batch import PPOTrainingState, prepare_ppo_batch


def test_remax_advantage_is_reward_minus_the_greedy_reward_of_the_prompt(tokenizer):
    engine = make_engine(build_model(len(tokenizer)), tokenizer)
    groups = [[([5, 6], [7, 1]), ([5, 6], [8, 9, 1])], [([6, 7], [5, 1])]]
    data = rollout_batch(engine, groups, rewards=[1.0, 0.0, 1.0])
    data.update_(type(data).from_tensors(
        ids=data.ids, seqlens={"baseline_rewards": [[1], [1]]},
        data={"baseline_rewards": torch.tensor([0.5, 1.0])},
    ))
    ppo = PPOHyperparameters(disable_value=True, adv_estimator="remax", kl_ctl=0.0,
                             adv_norm=False)
    batch, _ = prepare_ppo_batch(PPOTrainingState(ppo, max_new_tokens=8), data, None)
    advantages, mask = batch.data["advantages"], batch.data["loss_mask"]
    # prompt 0: 1.0 - 0.5 = 0.5 on 2 response tokens, 0.0 - 0.5 = -0.5 on 3; prompt 1: 1 - 1 = 0
    assert advantages[mask].tolist() == [0.5, 0.5, -0.5, -0.5, -0.5, 0.0, 0.0]
