"""realrl's built-in experiments; importing this package registers them."""

from realrl.experiments import dpo, gen, ppo_math, rw, sft  # noqa: F401
