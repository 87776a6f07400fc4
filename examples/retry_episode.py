"""An episode of one's own: answer, hear whether the answer is right, try once more.

The environment, not a tool, speaks between the two model turns; its words are not the model's,
so they never enter the loss. Train it on the built-in task with

    python -m realrl.apps.quickstart ppo-agent episode.module=examples/retry_episode.py \\
        episode.name=retry_once

The rule reward reads the model's turns joined by newlines and takes the last number, so a
right second answer earns the reward as a right first one does.
"""

from realrl.episodes import EpisodeEnv, EpisodeResult, Transcript, register_episode
from realrl.rewards.math_answer import extract_answer


@register_episode("retry_once")
async def retry_once(env: EpisodeEnv) -> EpisodeResult:
    transcript = Transcript(env.prompt_ids)
    for attempt in range(2):
        completion = await env.generate(transcript.ids)  # one model turn, batched with others
        transcript.add_model(completion)
        if not completion.ended or extract_answer(completion.text) == env.metadata["answer"]:
            break
        if attempt == 0:
            transcript.add_other(env.user_turn_ids("wrong:"))  # tokens outside the loss
    return transcript.result()
