"""Who a request belongs to, so that only its creator can abort it.

A caller's identity is the API key it presented when the router has keys (`--api-key KEY1,KEY2,...`: one key per
client or tenant; hashed, so no key is kept in the request table), else its connection. A gRPC request is further
bound to an owner token: the caller's own (`x-kvflow-owner-token` metadata on `Generate`), or one the router makes;
either way the router returns it in the call's initial metadata, and `Abort` must present it. So callers who share a
key, or a connection (two channels of one process, clients behind one proxy), still cannot abort each other's
requests; the SDK's `Client` sends one token of its own on every call.

Invariants: an identity never contains a key or a token in the clear; a gRPC owner without a token matches no
request; HTTP requests (aborted by disconnecting) have no token, so no gRPC `Abort` reaches them.
"""

from __future__ import annotations

import hashlib
import secrets

from cluster.request_ids import OWNER_TOKEN_METADATA

MAX_OWNER_TOKEN_CHARS = 128


def api_keys(configured: str | None) -> tuple[str, ...]:
    """`--api-key` (or KVFLOW_API_KEY): one key, or several separated by commas."""
    return tuple(key.strip() for key in (configured or "").split(",") if key.strip())


def presented_key(keys: tuple[str, ...], authorization: str) -> str | None:
    """The configured key an `Authorization: Bearer KEY` value presents, or None. Every key is compared, in
    constant time, so the answer's timing says nothing about which came close."""
    found = None
    for key in keys:
        if secrets.compare_digest(authorization.encode(), f"Bearer {key}".encode()):
            found = key
    return found


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def caller_identity(key: str | None, peer: str) -> str:
    """The key the caller presented (hashed) when the router has keys, else its connection (`peer`, e.g.
    "grpc:ipv4:10.0.0.7:51234")."""
    return f"key:{_digest(key)}" if key else f"peer:{peer}"


def owner_token(given: str | None) -> str:
    """The caller's own owner token when it is usable, else a fresh one."""
    if given and len(given) <= MAX_OWNER_TOKEN_CHARS and given.isprintable():
        return given
    return secrets.token_urlsafe(16)


def token_owner(identity: str, token: str | None) -> str:
    """A gRPC request's owner: its caller's identity and owner token; without a token, an owner no request has."""
    return f"{identity}/token:{_digest(token) if token else 'none'}"


__all__ = ["OWNER_TOKEN_METADATA", "api_keys", "caller_identity", "owner_token", "presented_key", "token_owner"]
