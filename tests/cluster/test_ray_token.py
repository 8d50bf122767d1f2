"""The Ray token file of a local `serve` is readable by its owner only."""

from __future__ import annotations

import stat

from halfmoon.cluster.control.ray_token import TOKEN_PATH_ENV, make_token_private, token_path


def test_the_token_file_is_made_owner_only(tmp_path, monkeypatch):
    token = tmp_path / "auth_token"
    token.write_text("secret")
    token.chmod(0o644)
    monkeypatch.setenv(TOKEN_PATH_ENV, str(token))
    assert token_path() == token
    assert make_token_private()
    assert stat.S_IMODE(token.stat().st_mode) == 0o600


def test_no_token_file_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_PATH_ENV, str(tmp_path / "missing"))
    assert not make_token_private()
    monkeypatch.delenv(TOKEN_PATH_ENV)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert token_path() == tmp_path / ".ray" / "auth_token"
