"""The built-in episode: answer, or call a tool and answer with its help.

``tool_arithmetic`` serves the built-in multiplication task (`dataset.builtin_task=
multiplication`, products of three-digit numbers, too hard for the tiny default model to do in
its head) and any prompt whose answer a tool can work out. An episode printed from the
default model after the 60 steps of the default ppo-agent run (raw format, `<eos>` ends a model
turn; the model's tokens in brackets; docs/agentic.md has more):

    99*322=[calc(99*322)<eos>]out(31878)[31878<eos>]

Each model turn either answers (the episode ends) or calls a tool (`realrl.episodes.tools`);
the tool output joins the sequence (`realrl.episodes.turns`) and the model takes another turn.
An episode whose ``episode.max_turns`` turns all call tools ends unanswered (its last tool
output joins the sequence, unused), as does a turn cut at gen.max_new_tokens or a sequence
too long for the model; those are marked ``no_eos``.
The reward is the rule reward's, on the model's own tokens (tool outputs are not its words).
"""

from __future__ import annotations

from realrl.episodes.api import EpisodeResult, Transcript, register_episode
from realrl.episodes.runner import EpisodeEnv


@register_episode("tool_arithmetic")
async def tool_arithmetic(env: EpisodeEnv) -> EpisodeResult:
    transcript = Transcript(env.prompt_ids)
    for _ in range(env.config.max_turns):
        if not env.fits(len(transcript.ids)):
            transcript.no_eos = True
            break
        completion = await env.generate(transcript.ids)
        transcript.add_model(completion)
        if not completion.ended:
            break  # cut at gen.max_new_tokens: no_eos
        output = await env.call_tool(completion.text)
        if output is None:
            break  # an answer
        transcript.add_tool(env.tool_turn_ids(output), output)
    else:
        transcript.no_eos = True  # every turn called a tool: no answer
    return transcript.result()
