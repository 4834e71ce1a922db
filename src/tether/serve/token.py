"""The server's bearer token (semantics §17.4): given, or made at start and kept in a file
``token`` beside the store (mode 0600), where clients of the same OS user find it.

A server also leaves a note in the user's ``~/.tether/servers/`` naming, by its port, the
token file it uses, so that ``tether`` finds the token of a server on this machine from
any directory. The note holds a path, never the token. Only a loopback URL is ever
matched with a local token: a remote server is never sent one it did not get from the
person.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

__all__ = [
    "TOKEN_FILE",
    "blank_is_none",
    "find_token",
    "forget_server",
    "note_server",
    "server_token",
]

TOKEN_FILE: Final = "token"
_NOTES: Final = Path.home() / ".tether" / "servers"
_LOOPBACK: Final = frozenset({"127.0.0.1", "localhost", "::1"})


def blank_is_none(token: str | None) -> str | None:
    """An empty or blank token is no token."""
    return token.strip() if token is not None and token.strip() else None


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)


def _read_private(path: Path) -> str | None:
    """The text of ``path`` if it is ours and no one else may read it."""
    try:
        st = path.stat()
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None
        return blank_is_none(path.read_text())
    except (OSError, UnicodeDecodeError):
        return None


def server_token(store_dir: Path) -> str:
    """The token kept in ``store_dir`` (made now if there is none): the same across a
    server's restarts, so that its clients stay signed in. Delete the file to change it."""
    _private_dir(store_dir)
    path = store_dir / TOKEN_FILE
    kept = _read_private(path)
    if kept is not None:
        return kept
    token = secrets.token_urlsafe(32)
    partial = store_dir / f".{TOKEN_FILE}.{os.getpid()}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    os.replace(partial, path)
    return token


def note_server(port: int, token_path: Path) -> None:
    """Leave the note that the server on ``port`` keeps its token in ``token_path``."""
    with contextlib.suppress(OSError):  # a home we cannot write: clients pass --token
        _private_dir(_NOTES)
        note = _NOTES / str(port)
        note.write_text(str(token_path.resolve()))
        note.chmod(0o600)


def forget_server(port: int, token_path: Path) -> None:
    """Remove the note of the server on ``port``, if it still names ``token_path``."""
    note = _NOTES / str(port)
    with contextlib.suppress(OSError):
        if note.read_text() == str(token_path.resolve()):
            note.unlink()


def find_token(url: str, given: str | None) -> str | None:
    """The token a client sends to ``url``: ``given`` (``--token``, ``$TETHER_TOKEN``) if
    not blank; for a server on this machine, the token file its note names, else the one
    in ``./.tether`` (the default store's directory)."""
    token = blank_is_none(given)
    if token is not None:
        return token
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if host not in _LOOPBACK:
        return None
    if port is not None:
        note = _read_private(_NOTES / str(port))
        if note is not None:
            found = _read_private(Path(note))
            if found is not None:
                return found
    return _read_private(Path(".tether") / TOKEN_FILE)
