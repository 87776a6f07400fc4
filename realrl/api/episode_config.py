"""The `episode` config section: multi-turn, tool-using rollouts (docs/agentic.md).

With `episode.name` set, the rollout MFC (`actor_gen`) runs that registered episode
(`realrl.episodes.register_episode`) once per response instead of sampling one response per
prompt; everything else in the graph is unchanged. The section is handed down to the actor's
interface as it is (`PPOActorConfig.episode`).
"""

from __future__ import annotations

from dataclasses import dataclass

from realrl.api.config import help_field

# The tools an episode may call (`realrl.episodes.tools.TOOLS`); api imports nothing above it,
# so the names are repeated here for validation and checked against the table by a test.
TOOL_NAMES = ("calc", "python")


@dataclass
class EpisodeConfig:
    name: str = help_field(
        "", "Registered episode that turns each prompt into a multi-turn rollout (built in: "
        "`tool_arithmetic`; docs/agentic.md). Empty: one response per prompt, no tools."
    )
    module: str = help_field(
        "", "A module path or .py file that registers `episode.name` with "
        "@register_episode; imported by the launcher and by every generation worker."
    )
    max_turns: int = help_field(
        3, "Most model turns per episode; each turn generates at most gen.max_new_tokens."
    )
    tools: list[str] = help_field(["calc", "python"], "Tools the episode may call.")
    tool_timeout_s: float = help_field(
        5.0, "Wall-clock limit of one python tool call (its CPU limit too); a call past it "
        "returns an error message as its output and the episode goes on."
    )
    tool_memory_mb: int = help_field(512, "Address-space limit of one python tool call.")
    max_tool_output_chars: int = help_field(
        64, "A tool's output is cut to this many characters before it joins the sequence."
    )
    max_parallel_tools: int = help_field(
        2, "Python tool calls running at once on one generation worker (each is a process)."
    )

    @property
    def enabled(self) -> bool:
        return bool(self.name)

    def validate(self, prefix: str) -> list[str]:
        problems = []
        if self.max_turns < 1:
            problems.append(f"`{prefix}.max_turns={self.max_turns}` must be >= 1.")
        unknown = [tool for tool in self.tools if tool not in TOOL_NAMES]
        if unknown:
            problems.append(f"`{prefix}.tools={list(self.tools)}` names unknown tools {unknown}; "
                            f"choose from {list(TOOL_NAMES)}.")
        for name in ("tool_timeout_s", "tool_memory_mb", "max_tool_output_chars",
                     "max_parallel_tools"):
            if getattr(self, name) <= 0:
                problems.append(f"`{prefix}.{name}={getattr(self, name)}` must be > 0.")
        return problems
