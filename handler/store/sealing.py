"""Reasoning sealed for the client to carry: ``include: ["reasoning.encrypted_content"]`` gives each reasoning item an
``encrypted_content`` only this deployment can open, so a stateless client (``store: false``) can send its reasoning
back and have it rendered as the model wrote it, without being able to read or alter it on the way.

Fernet (AES-128-CBC with an HMAC-SHA256 tag, from ``cryptography``): a blob altered, or sealed under another key,
does not open. The keys are ``option.responses_encryption_key`` (comma-separated: the first seals, every one opens,
so a new key is put first and an old one kept until the conversations sealed under it are over), else one the
master generated at start for its workers. What a blob holds: the reasoning text, tagged with what it is.
"""

from __future__ import annotations

import json

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

PURPOSE = "reasoning"  # what a blob holds, so a blob sealed for anything else does not open as reasoning


def new_key() -> str:
    return Fernet.generate_key().decode("ascii")


class ReasoningSeal:
    """Seals reasoning text into an opaque blob and opens it again (None: not sealed by these keys, or altered)."""

    def __init__(self, keys: str) -> None:
        self._fernet = MultiFernet([Fernet(key.strip().encode("ascii")) for key in keys.split(",") if key.strip()])

    def seal(self, text: str) -> str:
        return self._fernet.encrypt(json.dumps({PURPOSE: text}).encode()).decode("ascii")

    def open(self, blob: str) -> str | None:
        try:
            payload = json.loads(self._fernet.decrypt(blob.encode("ascii")))
        except (InvalidToken, UnicodeEncodeError, ValueError):
            return None
        text = payload.get(PURPOSE) if isinstance(payload, dict) else None
        return text if isinstance(text, str) else None
