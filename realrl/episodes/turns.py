"""How a tool's output joins an episode's token sequence: raw, or as a chat-template turn.

Raw (a tokenizer without a chat template, such as the built-in model's character tokenizer):
a model turn ends with the tokenizer's EOS, and the tool output follows as the text
``out(<output>)``; the model then continues the same sequence. Nothing here is whitespace, which
the built-in tokenizer drops.

Chat (`dataset.apply_chat_template` resolved true): a model turn ends with the template's
end-of-turn token (`<|im_end|>` for Qwen), which is added to the stop tokens; the tool output
becomes a ``tool`` message (a ``user`` message where the template refuses the ``tool`` role)
followed by the assistant header, exactly the tokens the template writes between the end of
one assistant turn and the start of the next. They are found by rendering a short
conversation with and without the tool message, so any template that renders turns one after
another works, without knowing its control tokens.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

RAW_TOOL_OUTPUT = "out({output})"
_MARKER = "realrl-episode-marker"


class TurnFormat:
    def __init__(self, tokenizer, chat_template: bool) -> None:
        # Imported here: `realrl.models` imports torch, and the launcher imports the episodes
        # (through ppo-agent's config) without it (tests/launcher/test_launcher_startup.py).
        from realrl.models.tokenizer import TextFormat

        self.tokenizer, self.chat_template = tokenizer, chat_template
        text_format = TextFormat(tokenizer, chat_template)
        # The token a model turn ends with: the template's end of turn, or EOS.
        self.stop_token_id: int | None = text_format.end_token_id
        self._tool_role = "tool"
        if chat_template:
            self._tool_role = self._working_tool_role()

    def tool_turn_ids(self, output: str) -> list[int]:
        """The tokens between a model turn that called a tool and the next model turn."""
        if not self.chat_template:
            text = RAW_TOOL_OUTPUT.format(output=output)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(self._chat_tail(output, self._tool_role),
                                     add_special_tokens=False)

    def user_turn_ids(self, text: str) -> list[int]:
        """The tokens of the environment's (the user's) words between two model turns: a user
        message through the chat template, or the text itself."""
        if not self.chat_template:
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(self._chat_tail(text, "user"), add_special_tokens=False)

    def _chat_tail(self, output: str, role: str) -> str:
        """The rendered text after the assistant turn's end token, up to the next assistant
        header."""
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARKER},
                    {"role": role, "content": output}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        tail = text.split(_MARKER, 1)[1]
        if self.stop_token_id is not None:
            end_text = self.tokenizer.convert_ids_to_tokens(self.stop_token_id)
            if tail.startswith(end_text):
                tail = tail[len(end_text):]
        return tail

    def _working_tool_role(self) -> str:
        try:
            if "tool-output" in self._chat_tail("tool-output", "tool"):
                return "tool"
        except Exception as error:  # a template may raise anything (jinja2 errors, its checks)
            logger.info("the chat template cannot render a tool message (%s): tool outputs "
                        "become user messages", error)
        return "user"
