"""Running mean/std normalisation of critic targets (``ppo.value_norm``).

Returns of language-model rewards drift in scale during training; regressing the critic on
normalised returns keeps the value loss well conditioned. This follows the ValueNorm of MAPPO
(Yu et al. 2022, "The Surprising Effectiveness of PPO in Cooperative Multi-Agent Games",
appendix), itself a simplification of PopArt (van Hasselt et al. 2016) without output rescaling.

The critic predicts normalised values; `denormalize` them before GAE, and `normalize` the
returns before the value loss. Call `update` once per step on the batch's returns (masked),
*before* normalising them for the loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from realrl.algo.distributed_stats import all_reduce_sum

VALUE_NORM_MODES = ("ema", "moving_average")


class ValueNormalizer:
    """Running statistics of value targets, global over ``process_group`` if given.

    - ``mode="ema"``: ``m <- beta m + (1 - beta) batch_mean`` (same for the mean of squares),
      divided by the debiasing term ``1 - beta^t`` like Adam, so early estimates are unbiased.
    - ``mode="moving_average"``: the exact mean and (population) variance of every value seen
      so far, kept as count-weighted running means of ``x`` and ``x^2``.

    ``std = sqrt(max(var, var_floor))`` with ``var_floor = 1e-2`` as in MAPPO, so a batch of
    nearly constant returns does not blow up the normalised values. Statistics are float64.
    """

    def __init__(
        self,
        mode: str = "ema",
        beta: float = 0.99995,
        var_floor: float = 1e-2,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if mode not in VALUE_NORM_MODES:
            raise ValueError(
                f"unknown ppo.value_norm_type={mode!r}; valid: {', '.join(VALUE_NORM_MODES)}"
            )
        if not 0.0 < beta < 1.0:
            raise ValueError(f"ppo.value_norm_beta must be in (0, 1), got {beta}")
        self.mode = mode
        self.beta = beta
        self.var_floor = var_floor
        self.process_group = process_group
        self.running_mean = torch.zeros((), dtype=torch.float64)
        self.running_mean_sq = torch.zeros((), dtype=torch.float64)
        self.debiasing_term = torch.zeros((), dtype=torch.float64)  # ema: 1 - beta^t
        self.count = torch.zeros((), dtype=torch.float64)  # moving_average: values seen

    @torch.no_grad()
    def update(self, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Fold in the masked entries of ``values`` (any shape; all ranks of the group call it)."""
        values = values.detach().double().cpu()
        weights = torch.ones_like(values) if mask is None else mask.detach().cpu().double()
        totals = torch.stack([weights.sum(), (values * weights).sum(), (values**2 * weights).sum()])
        totals = all_reduce_sum(totals, self.process_group)
        batch_count, batch_sum, batch_sum_sq = totals.unbind()
        if batch_count == 0:
            return
        batch_mean, batch_mean_sq = batch_sum / batch_count, batch_sum_sq / batch_count
        if self.mode == "ema":
            self.running_mean = self.beta * self.running_mean + (1 - self.beta) * batch_mean
            self.running_mean_sq = (
                self.beta * self.running_mean_sq + (1 - self.beta) * batch_mean_sq
            )
            self.debiasing_term = self.beta * self.debiasing_term + (1 - self.beta)
        else:
            total = self.count + batch_count
            fraction = batch_count / total  # weight of the new batch in the exact running mean
            self.running_mean = self.running_mean + fraction * (batch_mean - self.running_mean)
            self.running_mean_sq = self.running_mean_sq + fraction * (
                batch_mean_sq - self.running_mean_sq
            )
            self.count = total

    def mean_std(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Current (mean, std) as float64 scalars; (0, 1) before the first update."""
        if self.mode == "ema":
            if self.debiasing_term == 0:
                return torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)
            mean = self.running_mean / self.debiasing_term
            mean_sq = self.running_mean_sq / self.debiasing_term
        else:
            if self.count == 0:
                return torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)
            mean, mean_sq = self.running_mean, self.running_mean_sq
        variance = (mean_sq - mean**2).clamp(min=self.var_floor)
        return mean, variance.sqrt()

    def normalize(self, values: torch.Tensor) -> torch.Tensor:
        mean, std = self.mean_std()
        return ((values.double() - mean.to(values.device)) / std.to(values.device)).to(values.dtype)

    def denormalize(self, values: torch.Tensor) -> torch.Tensor:
        mean, std = self.mean_std()
        return (values.double() * std.to(values.device) + mean.to(values.device)).to(values.dtype)

    def state_dict(self) -> dict[str, torch.Tensor | str | float]:
        return {
            "mode": self.mode,
            "beta": self.beta,
            "var_floor": self.var_floor,
            "running_mean": self.running_mean.clone(),
            "running_mean_sq": self.running_mean_sq.clone(),
            "debiasing_term": self.debiasing_term.clone(),
            "count": self.count.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["mode"] != self.mode:
            raise ValueError(
                f"value-norm checkpoint was saved with mode {state['mode']!r} but this run uses "
                f"{self.mode!r}; set ppo.value_norm_type={state['mode']} to resume"
            )
        self.beta = float(state["beta"])
        self.var_floor = float(state["var_floor"])
        for name in ("running_mean", "running_mean_sq", "debiasing_term", "count"):
            setattr(self, name, state[name].to(torch.float64).clone())
