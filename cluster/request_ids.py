"""Request ids as kvflow's router and SDK mint them, in one place.

Contracts kept here:
- A caller's own id is used as given (the HTTP `x-request-id` header, `GenerateRequest.request_id`, the SDK's
  `request_id=`) when it has at most MAX_REQUEST_ID_CHARS characters; a missing or longer one is replaced by a
  minted one: 32 lowercase hex digits, a random UUID's (a 64 KB id would be echoed in every header and log line).
- A worker sees the router's id for each attempt, `<caller's id>@<8 hex digits>`: callers' ids may repeat (two
  callers, or one reusing an id), the router's do not, so an abort or a retry reaches exactly one worker request.
- A gRPC caller's owner token (OWNER_TOKEN_METADATA) travels with its `Generate` and `Abort` calls; the router
  answers each `Generate` with the token it bound the request to.
The ids built from these elsewhere are contracts too and stay where they are shaped: OpenAI's `cmpl-` / `chatcmpl-`
and `resp_` / `msg_` response ids (router/), and the offline `LLM`'s "0", "1", ... (vLLM's counter).
"""

from __future__ import annotations

import uuid

WORKER_SUFFIX_DIGITS = 8
MAX_REQUEST_ID_CHARS = 128
# gRPC metadata binding a request to its creator: only a caller presenting it may abort (router/ownership.py).
OWNER_TOKEN_METADATA = "x-kvflow-owner-token"


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id_or_new(given: str | None) -> str:
    """The caller's id when it gave one of at most MAX_REQUEST_ID_CHARS (an empty string is none), else a new one."""
    return given if given and len(given) <= MAX_REQUEST_ID_CHARS else new_request_id()


def attempt_request_id(request_id: str) -> str:
    """The id a worker gets for one attempt at `request_id`."""
    return f"{request_id}@{new_request_id()[:WORKER_SUFFIX_DIGITS]}"
