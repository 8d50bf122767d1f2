"""Ray's auth token file, made readable by its owner only: Ray writes it 0644, and anyone on
the host who reads it can call every actor of the cluster."""

from __future__ import annotations

import os
from pathlib import Path

TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


def token_path() -> Path:
    """Where Ray keeps the token of a Ray it starts: `$RAY_AUTH_TOKEN_PATH`, else
    `~/.ray/auth_token`."""
    return Path(os.environ.get(TOKEN_PATH_ENV) or Path.home() / ".ray" / "auth_token")


def make_token_private(path: Path | None = None) -> bool:
    """Set the token file to 0600; False when there is none (auth off, or a token given in
    `$RAY_AUTH_TOKEN`)."""
    path = path or token_path()
    if not path.is_file():
        return False
    path.chmod(0o600)
    return True
