"""Secrets: where they come from (the environment) and the one scrubber that keeps them out of
everything the plugin writes (the ledger, the terminal, engine logs)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any, TypeVar, cast

from pytest_gpubench.core.errors import GpubenchError

# A record (a ledger line, a rental) as its type says it is: scrubbing keeps its keys.
RecordT = TypeVar("RecordT", bound=Mapping[str, Any])

# Environment variables whose values are never written anywhere, whatever they are used for.
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
REDACTED = "[REDACTED]"
PRIVATE_KEY_BLOCK = re.compile(
    r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.DOTALL
)
# Shorter values would cut ordinary words out of the text.
MIN_SECRET_LENGTH = 4
# The userinfo of a URL: the password of `http://user:password@host`, and the whole of an HTTP
# URL's `https://token@host` (a token is often written as the user); `ssh://user@host` keeps its
# user name, which is no secret.
URL_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^\s/?#@:\"'<>\\]*)"
    r"(?P<password>:[^\s/?#@\"'<>\\]*)?@"
)
# A query parameter named like a secret (`?api_key=…`, `&access_token=…`, `X-Amz-Signature=…`).
SECRET_QUERY_PARAMETER = re.compile(
    r"(?P<name>[?&;][A-Za-z0-9_.\-]*(?:TOKEN|KEY|SECRET|PASSWORD|PASSWD|PWD|CREDENTIAL|AUTH|"
    r"SIGNATURE)[A-Za-z0-9_.\-]*=)[^&;\s#\"'<>\\]+",
    re.IGNORECASE,
)


def _without_userinfo_secret(match: re.Match[str]) -> str:
    scheme, user = match["scheme"], match["user"]
    if match["password"] is not None:
        return f"{scheme}{user}:{REDACTED}@"
    if scheme.lower() in ("http://", "https://", "ws://", "wss://"):
        return f"{scheme}{REDACTED}@"
    return match[0]


def scrub_url_credentials(text: str) -> str:
    """`http://user:secret@host/?api_key=k` -> `http://[REDACTED]@host/?api_key=[REDACTED]`."""
    text = URL_USERINFO.sub(_without_userinfo_secret, text)
    return SECRET_QUERY_PARAMETER.sub(lambda m: f"{m['name']}{REDACTED}", text)


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of environment variables whose names look secret."""
    environ = os.environ if environ is None else environ
    return [value for name, value in environ.items() if SECRET_NAME.search(name) and value]


def secret_from_env(name: str, *, owner: str, key: str) -> str:
    """The value of `$name`, which a cells.yaml key names; a usage error naming both if unset."""
    value = os.environ.get(name)
    if not value:
        raise GpubenchError(f"{owner}: {key}: ${name} is not set")
    return value


class SecretScrubber:
    """Replaces every known secret, any private key block and the credentials written into URLs
    (userinfo, key- or token-named query parameters), wherever they appear in text."""

    def __init__(self, secrets: list[str] | None = None) -> None:
        values = secret_values() if secrets is None else secrets
        # Longest first so a secret containing another is replaced whole.
        self._secrets = sorted(
            {s for s in values if len(s) >= MIN_SECRET_LENGTH}, key=len, reverse=True
        )

    def add(self, secret: str) -> None:
        """A secret learnt at run time (a rented node's key, a token read from a file)."""
        if len(secret) >= MIN_SECRET_LENGTH and secret not in self._secrets:
            self._secrets = sorted([*self._secrets, secret], key=len, reverse=True)

    def __call__(self, text: str) -> str:
        text = PRIVATE_KEY_BLOCK.sub(REDACTED, text)
        text = scrub_url_credentials(text)
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return text

    def record(self, record: RecordT) -> RecordT:
        """The record with every secret cut out of its values (the same keys: a new copy)."""
        return cast(RecordT, json.loads(self(json.dumps(record, default=str))))
