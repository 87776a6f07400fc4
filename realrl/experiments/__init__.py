"""realrl's built-in experiments; importing this package registers them."""

from realrl.experiments import dpo, gen, ppo_agent, ppo_math, ppo_rlhf, rw, sft  # noqa: F401
