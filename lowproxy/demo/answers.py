"""What the demo backend answers, in vLLM 0.33's shapes, route by route.

Non-streaming: one JSON object. Streaming: ``Stream(head, steps, tail)``, where
``steps`` holds the bytes of one generated token each (one event per choice)
so the backend can pace them and cut a stream short; chat and completions end
with ``data: [DONE]``, Responses and Messages send ``event:``/``data:`` pairs
and no ``[DONE]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..answers import json_body
from .engine import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Output, Parsed


@dataclass
class Result:
    """One finished (or about to be streamed) generation and its accounting."""

    parsed: Parsed
    request_id: str
    model: str
    created: int
    outputs: list[list[Output]]  # per prompt, n outputs each
    cached_tokens: int = 0
    details: bool = False  # --enable-prompt-tokens-details
    kv: Any = None  # the kv_transfer_params this answer carries
    return_token_ids: bool = False
    store: bool = False
    body: dict[str, Any] = field(default_factory=dict)

    @property
    def response_id(self) -> str:
        """A Responses answer's id: vLLM's is the request's request_id field (a
        vLLM extra, resp_<uuid> when absent), the key its response store uses."""
        given = self.body.get("request_id")
        return given if isinstance(given, str) else "resp_" + self.request_id

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.parsed.prompts)

    @property
    def choices(self) -> list[Output]:
        return [out for per_prompt in self.outputs for out in per_prompt]

    @property
    def completion_tokens(self) -> int:
        return sum(len(out.token_ids) for out in self.choices)


@dataclass
class Stream:
    """Built lazily: a stream may be long (benchmarks ask for 100k tokens), and
    events carry sequence numbers in the order they are written."""

    head: list[bytes]
    steps: Iterator[bytes]
    tail: Callable[[], list[bytes]]


def data(obj: Any) -> bytes:
    return b"data: " + json_body(obj) + b"\n\n"


def event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\n" + data({"type": kind, **obj})


def openai_usage(result: Result) -> dict[str, Any]:
    prompt, completion = result.prompt_tokens, result.completion_tokens
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion,
            # vLLM: null unless --enable-prompt-tokens-details
            "prompt_tokens_details": ({"cached_tokens": result.cached_tokens}
                                      if result.details else None)}


def answer(result: Result) -> dict[str, Any]:
    route = result.parsed.route
    if route in (CHAT, COMPLETIONS):
        return _openai(result)
    if route == RESPONSES:
        return responses_object(result, final=True)
    if route == MESSAGES:
        return _messages(result)
    return _generate(result)


def stream(result: Result) -> Stream:
    route = result.parsed.route
    if route in (CHAT, COMPLETIONS):
        return _openai_stream(result)
    if route == RESPONSES:
        return _responses_stream(result)
    if route == MESSAGES:
        return _messages_stream(result)
    return _generate_stream(result)


# -- chat and completions


def _openai(result: Result) -> dict[str, Any]:
    chat = result.parsed.route == CHAT
    choices = []
    for index, out in enumerate(result.choices):
        choice: dict[str, Any] = {"index": index}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        choice.update(logprobs=None, finish_reason=out.finish_reason,
                      stop_reason=out.stop_reason)
        if result.return_token_ids:
            choice["token_ids"] = out.token_ids
        choices.append(choice)
    body: dict[str, Any] = {
        "id": ("chatcmpl-" if chat else "cmpl-") + result.request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": result.created, "model": result.model, "choices": choices,
        "usage": openai_usage(result)}
    if result.return_token_ids:
        body["prompt_token_ids"] = result.parsed.prompts[0]
    body["kv_transfer_params"] = result.kv
    return body


def _openai_stream(result: Result) -> Stream:
    chat = result.parsed.route == CHAT
    base = {"id": ("chatcmpl-" if chat else "cmpl-") + result.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": result.created, "model": result.model}

    def steps() -> Iterator[bytes]:
        for i in range(max(len(out.pieces) for out in result.choices)):
            yield b"".join(data({**base, "choices": [_chunk_choice(chat, index, out, i)]})
                           for index, out in enumerate(result.choices)
                           if i < len(out.pieces))

    def tail() -> list[bytes]:
        events = []
        options = result.body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            events.append(data({**base, "choices": [], "usage": openai_usage(result)}))
        return events + [b"data: [DONE]\n\n"]

    return Stream([], steps(), tail)


def _chunk_choice(chat: bool, index: int, out: Output, i: int) -> dict[str, Any]:
    last = i == len(out.pieces) - 1
    choice: dict[str, Any] = {"index": index}
    if chat:
        choice["delta"] = {"content": out.pieces[i], **({"role": "assistant"} if i == 0 else {})}
    else:
        choice["text"] = out.pieces[i]
    choice.update(logprobs=None, finish_reason=out.finish_reason if last else None)
    return choice


# -- Responses (POST /v1/responses)


def responses_usage(result: Result) -> dict[str, Any]:
    prompt, completion = result.prompt_tokens, result.completion_tokens
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": result.cached_tokens},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _message_item(result: Result, text: str, done: bool) -> dict[str, Any]:
    content: list[dict[str, Any]] = [
        {"type": "output_text", "text": text, "annotations": [], "logprobs": None}]
    return {"id": "msg_" + result.request_id, "type": "message", "role": "assistant",
            "status": "completed" if done else "in_progress",
            "content": content if done else []}


def responses_object(result: Result, final: bool) -> dict[str, Any]:
    body, out = result.body, result.choices[0]
    incomplete = final and out.finish_reason == "length"
    status = ("incomplete" if incomplete else "completed") if final else "in_progress"
    return {
        "id": result.response_id, "object": "response",
        "created_at": result.created, "model": result.model, "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "output": [_message_item(result, out.text, True)] if final else [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "store": result.store, "temperature": body.get("temperature"),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools", []),
        "top_p": body.get("top_p"), "truncation": body.get("truncation", "disabled"),
        "background": bool(body.get("background")), "metadata": body.get("metadata"),
        "usage": responses_usage(result) if final else None,
        "kv_transfer_params": result.kv if final else None}


def _responses_stream(result: Result) -> Stream:
    out, item_id = result.choices[0], "msg_" + result.request_id
    seq = iter(range(1 << 30))

    def ev(kind: str, **obj: Any) -> bytes:
        return event(kind, {"sequence_number": next(seq), **obj})

    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    empty_part = {"type": "output_text", "text": "", "annotations": []}
    head = [ev("response.created", response=responses_object(result, False)),
            ev("response.in_progress", response=responses_object(result, False)),
            ev("response.output_item.added", output_index=0,
               item=_message_item(result, "", False)),
            ev("response.content_part.added", **where, part=empty_part)]
    steps = (ev("response.output_text.delta", **where, delta=piece, logprobs=[])
             for piece in out.pieces)

    def tail() -> list[bytes]:
        final = responses_object(result, True)
        kind = "response.incomplete" if final["status"] == "incomplete" else \
            "response.completed"
        return [ev("response.output_text.done", **where, text=out.text, logprobs=[]),
                ev("response.content_part.done", **where,
                   part={**empty_part, "text": out.text}),
                ev("response.output_item.done", output_index=0,
                   item=_message_item(result, out.text, True)),
                ev(kind, response=final)]

    return Stream(head, steps, tail)


# -- Messages (POST /v1/messages, Anthropic)

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def messages_usage(result: Result, output_tokens: int) -> dict[str, Any]:
    cached = result.cached_tokens if result.details else None
    created = 0 if result.details else None
    return {"input_tokens": result.prompt_tokens - (cached or 0) - (created or 0),
            "output_tokens": output_tokens, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": created}


def _stop_of(out: Output) -> tuple[str, str | None]:
    if out.finish_reason == "stop" and isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return STOP_REASONS[out.finish_reason], None


def _messages(result: Result) -> dict[str, Any]:
    out = result.choices[0]
    reason, sequence = _stop_of(out)
    return {"id": "msg_" + result.request_id, "type": "message", "role": "assistant",
            "model": result.model, "content": [{"type": "text", "text": out.text}],
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": messages_usage(result, result.completion_tokens),
            "kv_transfer_params": result.kv}


def _messages_stream(result: Result) -> Stream:
    out = result.choices[0]
    message = {**_messages(result), "content": [], "stop_reason": None,
               "stop_sequence": None, "usage": messages_usage(result, 0)}
    head = [event("message_start", {"message": message}),
            event("content_block_start", {"index": 0,
                                          "content_block": {"type": "text", "text": ""}})]
    steps = (event("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                 "text": piece}})
             for piece in out.pieces)
    reason, sequence = _stop_of(out)
    tail = [event("content_block_stop", {"index": 0}),
            event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": messages_usage(result, result.completion_tokens)}),
            event("message_stop", {})]
    return Stream(head, steps, lambda: tail)


# -- token in, token out (POST /inference/v1/generate)


def _generate(result: Result) -> dict[str, Any]:
    return {"request_id": result.request_id,
            "choices": [{"index": i, "logprobs": None, "finish_reason": out.finish_reason,
                         "token_ids": out.token_ids}
                        for i, out in enumerate(result.choices)],
            "prompt_logprobs": None, "kv_transfer_params": result.kv}


def _generate_stream(result: Result) -> Stream:
    out = result.choices[0]

    def steps() -> Iterator[bytes]:
        for i, token in enumerate(out.token_ids):
            last = i == len(out.token_ids) - 1
            yield data({"request_id": result.request_id, "choices": [
                {"index": 0, "logprobs": None, "token_ids": [token],
                 "finish_reason": out.finish_reason if last else None}]})

    return Stream([], steps(), lambda: [b"data: [DONE]\n\n"])

