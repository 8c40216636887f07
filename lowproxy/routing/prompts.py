"""Where a generation request's prompt is, per surface: read once, in one place.

The prefix key (affinity.py) and the prefix blocks (blocks.py) are both built
from the prompt; each surface keeps it in its own fields (chat ``messages``,
Messages ``system`` + ``messages``, Responses ``instructions`` + ``input``,
completions ``prompt``, generate ``token_ids``). ``prompt_of`` answers which,
so a new surface or field is taught here once.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple


class Conversation(NamedTuple):
    system: Any    # system text in its own field, or None (chat keeps it in messages)
    messages: Any  # the message list, as the client sent it (checked by the reader)


def prompt_of(surface: str, body: Mapping[str, Any]) -> Conversation | str | list | None:
    """The prompt: a Conversation, a completion's text, a list of token ids (not yet
    checked), or None for a shape with no single prompt (several prompts, none)."""
    if surface == "chat":
        return Conversation(None, body.get("messages"))
    if surface == "messages":
        return Conversation(body.get("system"), body.get("messages"))
    if surface == "responses":
        given = body.get("input")
        if isinstance(given, str):
            given = [{"role": "user", "content": given}]
        return Conversation(body.get("instructions"), given)
    if surface == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt):
            return prompt
        return None
    if surface == "generate":
        ids = body.get("token_ids")
        return ids if isinstance(ids, list) and ids else None
    return None


def message_text(content: Any) -> str:
    """The text of a message content: a string, or the ``text`` of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part["text"] for part in content
                       if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


__all__ = ["Conversation", "message_text", "prompt_of"]
