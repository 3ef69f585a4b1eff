"""Chat's `tools` and `tool_choice`: the prompt that offers the tools, the grammar that forces a call, and the
reply read back as OpenAI's `tool_calls`.

The prompt: a model whose chat template has a tools section (it names `tools`) renders them itself (the
template is given `tools`, as Hugging Face's apply_chat_template does). Otherwise (SmolLM2's template has
none) the **generic format**: a system message, first in the conversation (joined to the caller's own
system message when there is one), that lists the tools as JSON and asks for a reply that is only a JSON
object `{"name": <tool name>, "arguments": <object>}`. Earlier turns are written the same way: an assistant
message with `tool_calls` as that JSON, a `tool` message as its content.

`tool_choice`: "none" offers nothing and reads nothing back; "auto" (the default with tools) offers the tools
and reads the reply as a call when it is one of those objects naming a tool, as text otherwise; "required"
and a named function constrain decoding with a grammar (engine/grammar.py) for the call object: any of the
tools, or that one, its arguments following the tool's parameters schema.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loraplex.engine.structured_output import StructuredOutput

if TYPE_CHECKING:
    from .protocol import ChatMessage, ChunkMaker

GENERIC_INSTRUCTIONS = (
    "You can call the following tools. Each is given as a JSON object with its name, its description and "
    "the JSON schema of its arguments:\n{tools}\n"
    'To call a tool, reply with only a JSON object of the form {{"name": <tool name>, "arguments": '
    "<an object of the tool's arguments>}} and nothing else."
)
CHOICE_INSTRUCTIONS = {
    "auto": " If no tool is needed, reply to the user in plain text instead.",
    "required": " You must call one of the tools.",
}


def template_has_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (it reads a `tools` variable)."""
    return bool(template) and "tools" in str(template)


@dataclass(frozen=True)
class ToolCalls:
    """A chat request's tools (function tools, bounded by wire/limits.py's check_tools) and its choice:
    "auto", "required", or the one tool's name."""

    tools: list[dict[str, Any]]
    choice: str  # "auto" | "required" | "named"
    name: str | None = None  # the named tool

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None, tool_choice: Any) -> ToolCalls | None:
        """None when nothing is offered: no tools, or tool_choice "none"."""
        if not tools or tool_choice == "none":
            return None
        if isinstance(tool_choice, dict):
            return cls(tools, "named", tool_choice["function"]["name"])
        return cls(tools, tool_choice or "auto")

    @property
    def functions(self) -> list[dict[str, Any]]:
        offered = [t["function"] for t in self.tools]
        return [f for f in offered if self.name is None or f["name"] == self.name]

    # -- the prompt ---------------------------------------------------------------------------------

    def template_messages(self, messages: Sequence[ChatMessage], native: bool) -> list[dict[str, Any]]:
        """The conversation for the template: with `native` (the template renders `tools`), the messages
        with their tool fields; otherwise the generic format's system message and plain turns."""
        plain = [_plain_turn(m, i, keep_tool_fields=native) for i, m in enumerate(messages)]
        if native:
            return plain
        tools = "\n".join(
            json.dumps({k: f[k] for k in ("name", "description", "parameters") if k in f}, ensure_ascii=False)
            for f in self.functions
        )
        text = GENERIC_INSTRUCTIONS.format(tools=tools) + CHOICE_INSTRUCTIONS.get(self.choice, "")
        if self.name is not None:
            text += f" You must call the tool {self.name}."
        if plain and plain[0]["role"] == "system":
            return [{"role": "system", "content": f"{plain[0]['content']}\n\n{text}"}, *plain[1:]]
        return [{"role": "system", "content": text}, *plain]

    def template_tools(self) -> list[dict[str, Any]]:
        """What a template with a tools section is given (OpenAI's tool objects)."""
        return [{"type": "function", "function": f} for f in self.functions]

    # -- the grammar --------------------------------------------------------------------------------

    def structured(self) -> StructuredOutput | None:
        """The call object's schema for "required" and a named tool; None for "auto" (the model chooses)."""
        if self.choice == "auto":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.functions
        ]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return StructuredOutput.of(schema, strict=True, param="tools")

    # -- the reply ----------------------------------------------------------------------------------

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI's tool_calls when the reply is a call of an offered tool; None when it is text."""
        try:
            reply = json.loads(text.strip())
        except ValueError:
            return None
        names = {f["name"] for f in self.functions}
        if not isinstance(reply, dict) or reply.get("name") not in names:
            return None
        arguments = reply.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        call = {"name": reply["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": call}]

    def reply(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A whole chat choice, its message read as tool calls when it is one (finish_reason "tool_calls")."""
        message = choice["message"]
        calls = self.parse(message.get("content") or "") if choice["finish_reason"] == "stop" else None
        if calls is None:
            return choice
        return {
            **choice,
            "message": {**message, "content": None, "tool_calls": calls},
            "finish_reason": "tool_calls",
        }

    def final_chunks(self, chunks: ChunkMaker, text: str, reason: str, index: int) -> list[dict[str, Any]]:
        """The stream's last chunks of a choice whose text was held back: its tool calls as a delta (one
        chunk: id, type, name and arguments) then finish_reason "tool_calls"; or its text, then its end."""
        calls = self.parse(text) if reason == "stop" else None
        if calls is None:
            head = [chunks.text(text, index=index)] if text else []
            return [*head, chunks.text("", None, reason, index=index)]
        delta = chunks.text("", index=index)
        delta["choices"][0]["delta"] = {"tool_calls": [{"index": j, **call} for j, call in enumerate(calls)]}
        end = chunks.text("", None, reason, index=index)
        end["choices"][0]["finish_reason"] = "tool_calls"
        return [delta, end]


def _plain_turn(message: ChatMessage, index: int, keep_tool_fields: bool) -> dict[str, Any]:
    """One message for the template. The generic format writes an assistant's tool calls as the JSON it
    asks for (a tool's reply is a `tool` turn with its content); a native template gets the fields."""
    turn = message.for_template(index)
    extra = message.model_extra or {}
    calls = extra.get("tool_calls")
    if keep_tool_fields:
        turn.update({k: extra[k] for k in ("tool_calls", "tool_call_id") if k in extra})
        return turn
    if isinstance(calls, list) and calls and not turn["content"]:
        written = []
        for call in calls:
            function = call.get("function", {}) if isinstance(call, dict) else {}
            try:
                arguments = json.loads(function.get("arguments") or "{}")
            except ValueError:
                arguments = function.get("arguments")
            written.append(
                json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
            )
        turn["content"] = "\n".join(written)
    return turn


__all__ = ["GENERIC_INSTRUCTIONS", "ToolCalls", "template_has_tools"]
