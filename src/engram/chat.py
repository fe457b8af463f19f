"""`engram chat`: a terminal chat with a running server, streamed from `/v1/chat/completions`.

The conversation lives on the server (`conversation_id`): each turn sends only the new message,
and the server continues from the saved state of the previous turn."""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Iterator

import httpx


class ChatError(Exception):
    pass


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="the server's address")
    parser.add_argument("--api-key", default=None, help="the server's --api-key")
    parser.add_argument("--model", default=None, help="model name (default: the server's)")
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--max-tokens", type=int, default=512, help="longest reply in tokens")
    parser.add_argument("--temperature", type=float, default=0.7)


def run(ns: argparse.Namespace) -> None:
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    with httpx.Client(base_url=ns.url, headers=headers, timeout=httpx.Timeout(10.0, read=None)) as client:
        try:
            model = ns.model or _server_model(client)
        except (httpx.HTTPError, ChatError) as e:
            sys.exit(f"cannot reach the server at {ns.url}: {e}")
        print(f"chatting with {model} at {ns.url}; /reset starts over, /exit or Ctrl-D quits")
        system = [{"role": "system", "content": ns.system}] if ns.system else []
        conversation_id, pending = _new_conversation(), list(system)
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                print()
                return
            if line in ("/exit", "/quit"):
                return
            if line == "/reset":
                conversation_id, pending = _new_conversation(), list(system)
                print("(conversation reset)")
                continue
            if not line:
                continue
            body = {
                "model": model,
                "messages": pending + [{"role": "user", "content": line}],
                "conversation_id": conversation_id,
                "max_tokens": ns.max_tokens,
                "temperature": ns.temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            try:
                if _stream_reply(client, body):
                    pending = []  # the server holds them now
            except (httpx.HTTPError, ChatError) as e:
                print(f"\n[error] {e}", file=sys.stderr)


def _new_conversation() -> str:
    return f"chat-{uuid.uuid4().hex[:16]}"


def _server_model(client: httpx.Client) -> str:
    response = client.get("/v1/models")
    if response.status_code != 200:
        raise ChatError(_error_message(response))
    return response.json()["data"][0]["id"]


def _stream_reply(client: httpx.Client, body: dict) -> bool:
    """Print the reply as it streams; Ctrl-C stops it (the server then aborts the request and
    records no turn). Returns whether the turn completed."""
    usage = None
    print("assistant> ", end="", flush=True)
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                raise ChatError(_error_message(response))
            for event in _events(response):
                for choice in event["choices"]:
                    print(choice["delta"].get("content") or "", end="", flush=True)
                usage = event.get("usage") or usage
    except KeyboardInterrupt:
        print(" [interrupted]")
        return False
    print()
    if usage:
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        print(f"  [{usage['prompt_tokens']} prompt tokens ({cached} restored from saved state), {usage['completion_tokens']} generated]")
    return True


def _events(response: httpx.Response) -> Iterator[dict]:
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise ChatError(event["error"]["message"])
        yield event


def _error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"
