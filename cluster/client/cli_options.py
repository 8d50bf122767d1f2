"""The command-line options a client of a running server takes: its API key (from a file,
the environment or the flag) and the CA to trust over TLS."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from halfmoon.cluster.frontend.auth import API_KEY_ENV


def add_api_key(cmd, purpose: str) -> None:
    key = cmd.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"{purpose} (default: ${API_KEY_ENV}; unset: none). Visible to every user in "
        "`ps`: prefer --api-key-file or the variable",
    )
    key.add_argument(
        "--api-key-file",
        action=_KeyFile,
        dest="api_key",
        default=argparse.SUPPRESS,
        metavar="PATH",
        help=f"read {purpose} from this file (its first line)",
    )


class _KeyFile(argparse.Action):
    """Reads an API key from a file, so it never shows in the process list."""

    def __call__(self, parser, namespace, path, option_string=None) -> None:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as error:
            parser.error(f"{option_string} {path}: {error.strerror}")
        if not lines or not lines[0].strip():
            parser.error(f"{option_string} {path}: the file is empty; put the key on line 1")
        setattr(namespace, self.dest, lines[0].strip())


def add_tls_ca(cmd) -> None:
    cmd.add_argument("--tls-ca", help="PEM CA certificate: connect over TLS, trusting this CA")
