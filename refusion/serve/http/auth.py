"""The API key: the one check of it, for the server and for the replica front alike."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

from ..playground import is_public
from ..protocol.errors import APIError


def authorised(scope: Mapping[str, Any], api_key: str | None) -> bool:
    """Whether a request may pass: no key set, /health (which never needs one), or
    'Authorization: Bearer KEY' with the key. The playground's page and files pass too:
    the page asks for the key and sends it."""
    if api_key is None or scope["path"] == "/health" or is_public(scope["path"]):
        return True
    for k, v in scope["headers"]:
        if k == b"authorization":
            scheme, _, token = v.decode("latin-1").partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode(), api_key.encode()
            )
    return False


def unauthorised() -> APIError:
    return APIError(
        401,
        "invalid or missing API key: send 'Authorization: Bearer <key>'",
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )
