"""Python client for an Engram server: chat by conversation, and the snapshot routes.
For example:

    client = EngramClient("http://127.0.0.1:30000")
    conv = client.conversation()
    conv.chat("Hello")          # sends only the new message; the server keeps the state
    SnapshotManager(client).list_conversation(conv.conversation_id)
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx


class EngramError(RuntimeError):
    """An error answer from the server; `status` is the HTTP status code. A `RuntimeError`, as
    the predecessor's `SnapshotManager` raised for every failure."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class AuthenticationError(EngramError):
    pass


class SnapshotNotFoundError(EngramError):
    pass


class SnapshotBusyError(EngramError):
    """The conversation has a request in flight."""


class SnapshotIncompatibleError(EngramError):
    """The snapshot was made by another model or tokenizer, or its file is damaged."""


class InvalidRequestError(EngramError):
    pass


def _error_for(response: httpx.Response) -> EngramError:
    try:
        body = response.json()
    except ValueError:
        body = {}
    detail = body.get("error", body) if isinstance(body, dict) else body
    message = detail.get("message", response.text) if isinstance(detail, dict) else str(detail)
    status = response.status_code
    if status == 401:
        return AuthenticationError(status, message)
    if status == 404:
        return SnapshotNotFoundError(status, message)
    if status == 409:
        kind = (detail.get("type") or "") if isinstance(detail, dict) else ""
        return SnapshotIncompatibleError(status, message) if "incompatible" in kind or "corrupt" in kind else SnapshotBusyError(status, message)
    if status in (400, 422):
        return InvalidRequestError(status, message)
    return EngramError(status, message)


class EngramClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 300.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> EngramClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, body: dict | None = None, headers: dict[str, str] | None = None) -> Any:
        response = self.http.request(method, path, json=body, headers=headers)
        if response.status_code >= 400:
            raise _error_for(response)
        return response.json()

    def model(self) -> str:
        return self.request("GET", "/v1/models")["data"][0]["id"]

    def chat(self, messages: list[dict], idempotency_key: str | None = None, **fields: Any) -> dict:
        """POST /v1/chat/completions; extension fields (conversation_id, branch, from_turn,
        expected_turn) pass through."""
        body = {"model": fields.pop("model", None) or self.model(), "messages": messages, **fields}
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self.request("POST", "/v1/chat/completions", {k: v for k, v in body.items() if v is not None}, headers)

    def generate(self, text: str | None = None, input_ids: list[int] | None = None, **fields: Any) -> dict:
        body = {"text": text, "input_ids": input_ids, **fields}
        return self.request("POST", "/generate", {k: v for k, v in body.items() if v is not None})

    def get_conversation(self, conversation_id: str) -> dict:
        return self.request("GET", f"/v1/conversations/{conversation_id}")

    def delete_conversation(self, conversation_id: str) -> dict:
        return self.request("DELETE", f"/v1/conversations/{conversation_id}")

    def conversation(self, conversation_id: str | None = None, branch: str = "main", **defaults: Any) -> Conversation:
        return Conversation(self, conversation_id, branch, **defaults)


class SnapshotManager:
    """The snapshot routes, with the method and argument names of the SGLang-based predecessor's
    `SnapshotManager` (`endpoint`: an `EngramClient`, `Runtime.endpoint`, or the server's URL).
    Unlike it, `get_info` and `delete` take the branch's latest turn when no turn is named."""

    def __init__(self, endpoint: str | EngramClient, api_key: str | None = None):
        self.client = endpoint if isinstance(endpoint, EngramClient) else EngramClient(endpoint, api_key)

    def _post(self, path: str, **fields: Any) -> dict:
        return self.client.request("POST", path, {k: v for k, v in fields.items() if v is not None})

    def list_conversation(self, conversation_id: str) -> list[dict]:
        return self._post("/list_snapshots", conversation_id=conversation_id)["snapshots"]

    def get_info(self, conversation_id: str, turn_number: int | None = None, branch_name: str | None = None) -> dict:
        return self._post("/get_snapshot_info", conversation_id=conversation_id, turn_number=turn_number, branch_name=branch_name)

    def save(
        self, conversation_id: str | None = None, rid: str | None = None, turn_number: int | None = None, branch_name: str | None = None
    ) -> dict:
        return self._post("/save_snapshot", conversation_id=conversation_id, rid=rid, turn_number=turn_number, branch_name=branch_name)

    def restore(
        self,
        rid: str | None = None,
        conversation_id: str | None = None,
        turn_number: int | None = None,
        branch_name: str | None = None,
        *,
        create_new_request: bool = False,
        continuation_ids: list[int] | None = None,
        max_new_tokens: int | None = None,
        sampling_params: dict | None = None,
    ) -> dict:
        """Restore-only (with `rid`: staged for the `/generate` request of that id), or with
        `create_new_request` restore and generate from the snapshot's tokens + `continuation_ids`."""
        if conversation_id is None:
            raise TypeError("restore() needs a conversation_id")
        return self._post(
            "/restore_snapshot",
            rid=rid,
            conversation_id=conversation_id,
            turn_number=turn_number,
            branch_name=branch_name,
            create_new_request=create_new_request,
            continuation_ids=continuation_ids,
            max_new_tokens=max_new_tokens,
            sampling_params=sampling_params,
        )

    def delete(self, conversation_id: str, turn_number: int | None = None, branch_name: str | None = None) -> bool:
        """True if the snapshot was deleted, False if there was none (as the predecessor answered)."""
        try:
            return self._post("/delete_snapshot", conversation_id=conversation_id, turn_number=turn_number, branch_name=branch_name)["success"]
        except SnapshotNotFoundError:
            return False


class Conversation:
    """A server-side conversation: `.chat(text)` sends only the new user turn. Each turn carries an
    idempotency key: a turn whose answer was lost (a timeout, a dropped connection) or that is
    still in flight is sent again up to `retries` times, and the server answers it once."""

    def __init__(
        self,
        client: EngramClient,
        conversation_id: str | None = None,
        branch: str = "main",
        *,
        retries: int = 2,
        retry_wait: float = 0.5,
        **defaults: Any,
    ):
        self.client = client
        self.conversation_id = conversation_id or f"conv-{uuid.uuid4().hex[:16]}"
        self.branch = branch
        self.retries, self.retry_wait = retries, retry_wait
        self.defaults = defaults
        self.turn = 0
        self.epoch: str | None = None  # the server's; it changes when the server restarts
        self.last_response: dict | None = None
        self._fork_from: int | None = None  # the turn a forked branch's first chat starts from

    def chat(self, text: str, role: str = "user", from_turn: int | None = None, **fields: Any) -> str:
        key = uuid.uuid4().hex
        for attempt in range(self.retries + 1):
            try:
                response = self.client.chat(
                    [{"role": role, "content": text}],
                    idempotency_key=key,
                    conversation_id=self.conversation_id,
                    branch=self.branch,
                    from_turn=from_turn if from_turn is not None else self._fork_from,
                    **{**self.defaults, **fields},
                )
                break
            except (httpx.TransportError, SnapshotBusyError):
                if attempt == self.retries:
                    raise
                time.sleep(self.retry_wait * 2**attempt)
        self._fork_from = None
        self.turn = response.get("turn", self.turn + 1)
        self.epoch = response.get("epoch", self.epoch)
        self.last_response = response
        return response["choices"][0]["message"]["content"]

    def fork(self, branch: str, from_turn: int) -> Conversation:
        """A handle on a new branch that will start from `from_turn` of this one."""
        forked = Conversation(self.client, self.conversation_id, branch, retries=self.retries, retry_wait=self.retry_wait, **self.defaults)
        forked.turn = from_turn
        forked._fork_from = from_turn
        return forked
