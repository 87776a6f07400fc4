"""Agentic rollouts: multi-turn, tool-using episodes run inside the rollout MFC (docs/agentic.md).

`api` (what an episode is, `register_episode`), `runner` (many episodes at once, model turns
batched), `tools` (calculator, sandboxed Python, the call parser), `turns` (raw or chat-template
tool turns), `builtin` (the ``tool_arithmetic`` episode), `rollout` (``actor_gen``'s episode
mode, packed as the usual rollout keys).
"""

from realrl.episodes.api import (
    Completion,
    EpisodeResult,
    Transcript,
    get_episode,
    register_episode,
)
from realrl.episodes.runner import EpisodeEnv

__all__ = ["Completion", "EpisodeEnv", "EpisodeResult", "Transcript", "get_episode",
           "register_episode"]
