"""Chat rendering: the prompt an environment opens with and the tokens of each environment turn.

Both sides call these with the same tokenizer (pinned by hash in the manifest), so the environment tokens a
volunteer generated with and the ones the coordinator's replay computes are the same bytes.

With a chat template, an environment turn is the text the template adds after the assistant's stop token:
render the conversation with the new messages (and the next generation prompt) and keep what follows the
last assistant turn's end marker (`<|im_end|>` for Qwen/ChatML: the template's newline after it belongs to
the environment turn, the marker itself to the model). Tool schemas go to the template (`tools=`), which is
how Qwen shows them; a template that ignores `tools=` (SmolLM2's plain ChatML) gets the same Hermes tool
block Qwen's template writes, in its system turn (`tool_system_text`), so the model sees the schemas and the
`<tool_call>` format either way. Without a template (the tiny model's plain tokenizer) a turn is its contents
joined by spaces, between spaces.
"""

from __future__ import annotations

from asyncrl.tasks.sources import encode_prompt

import json

from .base import EnvError

TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                "with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")


def tool_system_text(system: str, tools: list[dict]) -> str:
    """`system` followed by the Hermes/Qwen2.5 tool block (the text Qwen's template renders for `tools=`)."""
    listed = "".join("\n" + json.dumps(t) for t in tools)
    return (system + "\n\n" if system else "") + TOOLS_HEADER + listed + TOOLS_FOOTER


class Renderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.end_text = tokenizer.eos_token or ""  # the assistant turn's end marker as text

    def _chat(self, messages: list[dict], tools: list[dict], generation: bool) -> str:
        if tools and not self._renders_tools():
            messages, tools = self._tools_in_system(messages, tools), []
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=generation)

    def _renders_tools(self) -> bool:
        """Does the template show `tools=`? (Rendered once with a probe schema, remembered.)"""
        if not hasattr(self, "_tools_ok"):
            probe = [{"type": "function", "function": {"name": "asyncrl_probe_tool", "parameters": {}}}]
            chat = [{"role": "user", "content": "x"}]
            self._tools_ok = "asyncrl_probe_tool" in self.tokenizer.apply_chat_template(chat, tools=probe,
                                                                                         tokenize=False)
        return self._tools_ok

    @staticmethod
    def _tools_in_system(messages: list[dict], tools: list[dict]) -> list[dict]:
        first = messages[0] if messages and messages[0].get("role") == "system" else None
        system = {"role": "system", "content": tool_system_text(first["content"] if first else "", tools)}
        return [system] + list(messages[1:] if first else messages)

    def prompt_text(self, messages: list[dict], tools: list[dict] = ()) -> str:
        if self.templated:
            return self._chat(list(messages), list(tools), True)
        return " ".join(m["content"] for m in messages) + " "

    def prompt_ids(self, messages: list[dict], tools: list[dict] = ()) -> list[int]:
        """As the lease carries them (tasks.sources.encode_prompt, the one prompt encoder)."""
        return list(encode_prompt(self.tokenizer, self.prompt_text(messages, tools)))

    def env_text(self, history: list[dict], env_messages: list[dict], tools: list[dict] = ()) -> str:
        """The text between the assistant turn that ends `history` and the next assistant turn."""
        if not self.templated:
            return " " + " ".join(m["content"] for m in env_messages) + " "
        before = self._chat(history, list(tools), False)
        after = self._chat(history + list(env_messages), list(tools), True)
        cut = before.rfind(self.end_text) if self.end_text else -1
        if cut < 0 or after[:cut + len(self.end_text)] != before[:cut + len(self.end_text)]:
            raise EnvError("the chat template does not render the environment turn as a suffix of the conversation")
        return after[cut + len(self.end_text):]

    def env_ids(self, history: list[dict], env_messages: list[dict], tools: list[dict] = ()) -> list[int]:
        return list(self.tokenizer(self.env_text(history, env_messages, tools), add_special_tokens=False)["input_ids"])

    def assistant_text(self, ids) -> str:
        """What `step` is given for a model turn (special tokens dropped, as the reward path decodes)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
