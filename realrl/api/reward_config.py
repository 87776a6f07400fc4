"""The `reward` section of the PPO-family experiments (ppo-math, ppo-rlhf): where rewards come from.

`reward.sources` picks one source or several, whose rewards are summed with the weights
`reward.<source>.weight` into the `rewards` key the actor and critic train on:

- `rule`: the verifiers of the built-in tasks (math answers, code tests), MFC `rew_inf`;
- `model`: a learned reward model, an `rw` run's checkpoint in `rm.path` (the `rm` role, with
  its own allocation), scored at the last token of prompt + response, optionally normalised
  and clipped, MFC `rm_inf`;
- `remote`: an HTTP reward service (`realrl.rewards.remote`), MFC `remote_inf`.

Each section is also the typed config of its MFC's interface (handed down unchanged); the
graph they form is built by `realrl.experiments.reward_graph`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from realrl.api.config import InertKeys, help_field, value_text


class RewardSource(str, enum.Enum):
    rule = "rule"
    model = "model"
    remote = "remote"


# What puts each reward section in a run's graph (`BaseExperimentConfig.section_enablers`).
REWARD_SECTION_ENABLERS = {
    "rew_inf": "`rule` in `reward.sources`",
    "rm": "`model` in `reward.sources`",
    "rm_inf": "`model` in `reward.sources`",
    "remote_inf": "`remote` in `reward.sources`",
    "reward_sum": "two or more `reward.sources`, or a `reward.<source>.weight` other than 1",
}


class ScoreNormalization(str, enum.Enum):
    none = "none"
    fixed = "fixed"
    running = "running"


@dataclass
class RuleRewardConfig:
    weight: float = help_field(1.0, "Weight of this source in the reward sum.")
    math_timeout_s: float = help_field(5.0, "Per-answer timeout of the math verifier.")
    code_timeout_s: float = help_field(5.0, "Per-program wall-clock timeout of the code sandbox.")
    num_workers: int = help_field(1, "Verifier/sandbox worker processes.")


@dataclass
class ModelRewardConfig:
    weight: float = help_field(1.0, "Weight of this source in the reward sum.")
    normalize: ScoreNormalization = help_field(
        ScoreNormalization.none, "How a score becomes a reward. none: the score as it is. "
        "fixed: (score - offset) / scale. running: (score - mean) / std over every score of "
        "the run so far, this step's batch included (all data-parallel ranks of rm_inf; std at "
        "least 0.1), like OpenRLHF's normalize_reward; the statistics live in the workers, "
        "and a resumed run starts them again."
    )
    offset: float = help_field(
        0.0, "normalize=fixed: subtracted from the score, e.g. the reward model's mean score "
        "on held-out data."
    )
    scale: float = help_field(
        1.0, "normalize=fixed: the score minus offset is divided by it, e.g. the scores' std."
    )
    clip: float | None = help_field(
        None, "Clip the (normalised) reward to [-clip, clip]; null: no clipping."
    )


@dataclass
class RemoteRewardConfig:
    weight: float = help_field(1.0, "Weight of this source in the reward sum.")
    url: str = help_field(
        "", "http(s) URL of the reward service. Each request is a JSON POST {\"items\": "
        "[{\"prompt\", \"response\", \"metadata\"}, ...]}, answered by {\"rewards\": [number, "
        "...]} in the same order (docs/rewards.md; examples/reward_server.py)."
    )
    timeout_s: float = help_field(
        30.0, "Seconds to wait for the service to connect and for each read of its answer."
    )
    max_retries: int = help_field(
        3, "Retries of a request that timed out, could not connect, or got HTTP 408, 429 or "
        "5xx; then the run stops with an error naming the URL. A malformed answer or another "
        "HTTP error stops it at once."
    )
    backoff_s: float = help_field(
        1.0, "Wait before the first retry; each further retry waits twice as long."
    )
    max_items_per_request: int | None = help_field(
        None, "Split a call's responses into requests of at most this many, sent one after "
        "another; null: one request per call and data-parallel rank."
    )
    token_env: str = help_field(
        "", "Name of an environment variable holding a token for the service, sent as "
        "`Authorization: Bearer <token>` (the token itself never enters the config or the run "
        "directory); empty: no Authorization header."
    )


@dataclass
class RewardConfig:
    sources: list[RewardSource] = help_field(
        [RewardSource.rule], "Where rewards come from, e.g. [rule], [model], [rule,remote]: "
        "rule (the math/code verifiers), model (the reward model in rm.path), remote (the HTTP "
        "service at reward.remote.url). Several sources are summed with their "
        "`reward.<source>.weight` (MFC reward_sum)."
    )
    rule: RuleRewardConfig = help_field(RuleRewardConfig(), "The rule-based verifiers (MFC rew_inf).")
    model: ModelRewardConfig = help_field(
        ModelRewardConfig(), "The reward model's scores (MFC rm_inf on role rm)."
    )
    remote: RemoteRewardConfig = help_field(
        RemoteRewardConfig(), "The HTTP reward service (MFC remote_inf)."
    )

    def weights(self) -> dict[RewardSource, float]:
        """Each selected source's weight, in the order of `sources`."""
        return {source: getattr(self, source.value).weight for source in self.sources}

    def needs_sum(self) -> bool:
        """Whether a `reward_sum` MFC combines the sources: more than one, or one whose weight
        changes its rewards."""
        return len(self.sources) > 1 or any(weight != 1.0 for weight in self.weights().values())

    def inert_keys(self, prefix: str) -> list[InertKeys]:
        return [InertKeys((f"{prefix}.{source.value}.",),
                          f"with `{prefix}.sources={value_text(self.sources)}`",
                          f"add {source.value} to {prefix}.sources")
                for source in RewardSource if source not in self.sources] + (
            [InertKeys((f"{prefix}.model.offset", f"{prefix}.model.scale"),
                       f"with `{prefix}.model.normalize={self.model.normalize.value}`",
                       f"set {prefix}.model.normalize=fixed")]
            if RewardSource.model in self.sources
            and self.model.normalize != ScoreNormalization.fixed else [])

    def validate(self, prefix: str) -> list[str]:
        problems = []
        if not self.sources:
            problems.append(f"`{prefix}.sources=[]` selects no reward; pick from "
                            f"{[source.value for source in RewardSource]}, e.g. [rule].")
        repeated = sorted({s.value for s in self.sources if self.sources.count(s) > 1})
        if repeated:
            problems.append(f"`{prefix}.sources` names {repeated} more than once.")
        for source, weight in self.weights().items():
            if not math.isfinite(weight):
                problems.append(f"`{prefix}.{source.value}.weight={weight}` must be finite.")
        if RewardSource.model in self.sources:
            problems += _model_problems(self.model, f"{prefix}.model")
        if RewardSource.remote in self.sources:
            problems += _remote_problems(self.remote, f"{prefix}.remote")
        return problems


def _model_problems(model: ModelRewardConfig, prefix: str) -> list[str]:
    problems = []
    if model.normalize == ScoreNormalization.fixed and model.scale <= 0:
        problems.append(f"`{prefix}.scale={model.scale}` must be > 0 with "
                        f"`{prefix}.normalize=fixed` (the score is divided by it).")
    if model.clip is not None and model.clip <= 0:
        problems.append(f"`{prefix}.clip={model.clip}` must be > 0, or null for no clipping.")
    return problems


def _remote_problems(remote: RemoteRewardConfig, prefix: str) -> list[str]:
    problems = []
    parts = urlsplit(remote.url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        problems.append(f"`{prefix}.url={remote.url!r}` must be an http:// or https:// URL of the "
                        "reward service, e.g. http://localhost:8000/score.")
    if remote.timeout_s <= 0:
        problems.append(f"`{prefix}.timeout_s={remote.timeout_s}` must be > 0.")
    if remote.max_retries < 0:
        problems.append(f"`{prefix}.max_retries={remote.max_retries}` must be >= 0.")
    if remote.backoff_s < 0:
        problems.append(f"`{prefix}.backoff_s={remote.backoff_s}` must be >= 0.")
    if remote.token_env and not remote.token_env.isidentifier():
        problems.append(f"`{prefix}.token_env={remote.token_env!r}` must be the NAME of an "
                        "environment variable holding the token, e.g. REWARD_API_TOKEN, not "
                        "the token itself.")
    if remote.max_items_per_request is not None and remote.max_items_per_request < 1:
        problems.append(f"`{prefix}.max_items_per_request={remote.max_items_per_request}` must "
                        "be >= 1, or null for one request per call.")
    return problems


def source_key(source: str) -> str:
    """The batch key of one source's rewards, e.g. ``rule_rewards``."""
    return f"{source}_rewards"
