"""The API key: the one check of it, for the server and for the replica front alike."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

from ...errors import ConfigError
from ..playground import is_public
from ..protocol.errors import APIError


def check_api_key(api_key: str | None) -> None:
    """Refuse, before the server starts, a key no client could send: HTTP header values
    are bytes that clients write from ASCII text (httpx and the openai client refuse
    anything else; others send Latin-1 or UTF-8, so the bytes would not be the key's),
    and a space or control character would not survive the header. The key is then
    compared as its ASCII bytes, whatever a client sends."""
    if api_key is None:
        return
    if not api_key or not all("!" <= c <= "~" for c in api_key):
        raise ConfigError(
            "--api-key (or $REFUSION_API_KEY) must be printable ASCII without spaces, as HTTP headers carry "
            "it: use letters, digits and punctuation (e.g. the output of `openssl rand -hex 32`)"
        )


def authorised(scope: Mapping[str, Any], api_key: str | None) -> bool:
    """Whether a request may pass: no key set, /health (which never needs one), or
    'Authorization: Bearer KEY' with the key, compared as bytes (`check_api_key` makes it
    ASCII) in constant time. The playground's page and files pass too: the page asks for
    the key and sends it."""
    if api_key is None or scope["path"] == "/health" or is_public(scope["path"]):
        return True
    for k, v in scope["headers"]:
        if k == b"authorization":
            scheme, _, token = v.partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode("ascii"))
    return False


def unauthorised() -> APIError:
    return APIError(
        401,
        "invalid or missing API key: send 'Authorization: Bearer <key>'",
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
