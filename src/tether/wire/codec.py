"""Length-prefixed framing over a stream socket, with a size cap.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack. A frame
that fails to decode, for any reason (malformed, wrong type, nested deeper than the
decoder recurses), is a ``FrameError``; a length over the cap is ``FrameTooLarge``, after
which the stream can no longer be trusted. What a bad frame means for its sender is the
receiver's policy (the pool treats any bad frame as a faulty worker).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from typing import Generic, TypeVar

import msgspec

from tether.wire.errors import FrameError

__all__ = ["MAX_FRAME", "Channel", "FrameTooLarge"]

MAX_FRAME = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")

In = TypeVar("In")


class FrameTooLarge(FrameError):
    """The peer announced a frame over the cap: the stream can no longer be trusted."""


class Channel(Generic[In]):
    """One end of a framed, typed, bidirectional channel.

    Sends may come from several threads (a lock keeps frames whole); receives from one.
    """

    def __init__(
        self, sock: socket.socket, incoming: type[In] | object, max_frame: int = MAX_FRAME
    ) -> None:
        self.sock = sock
        self._reader = sock.makefile("rb")
        self._decoder: msgspec.msgpack.Decoder[In] = msgspec.msgpack.Decoder(incoming)
        self._encoder = msgspec.msgpack.Encoder()
        self._max = max_frame
        self._send_lock = threading.Lock()

    def send(self, frame: msgspec.Struct) -> None:
        self.send_bytes(self._encoder.encode(frame))

    def encode(self, frame: msgspec.Struct) -> bytes:
        """``frame`` as the bytes ``send_bytes`` takes; FrameError if over the cap.

        Lets a sender check and queue a frame now and write it later from another thread.
        """
        payload = self._encoder.encode(frame)
        self._check(payload)
        return payload

    def _check(self, payload: bytes) -> None:
        if len(payload) > self._max:
            raise FrameError(f"frame of {len(payload)} bytes is over the {self._max}-byte cap")

    def send_bytes(self, payload: bytes) -> None:
        self._check(payload)
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(payload)) + payload)

    def recv(self) -> In:
        """The next frame. EOFError at a clean end (between frames); FrameError for a
        bad frame, a frame cut short included."""
        header = self._reader.read(_HEADER.size)
        if not header:
            raise EOFError
        if len(header) < _HEADER.size:
            raise FrameError(f"frame cut short: {len(header)} of {_HEADER.size} header bytes")
        (length,) = _HEADER.unpack(header)
        if length > self._max:
            raise FrameTooLarge(f"frame of {length} bytes is over the {self._max}-byte cap")
        payload = self._reader.read(length)
        if len(payload) < length:
            raise FrameError(f"frame cut short: {len(payload)} of {length} bytes")
        try:
            return self._decoder.decode(payload)
        except Exception as exc:  # DecodeError, and RecursionError for deep nesting, ...
            detail = exc if isinstance(exc, msgspec.DecodeError) else repr(exc)
            raise FrameError(f"undecodable frame of {length} bytes: {detail}") from None

    def close(self) -> None:
        self._reader.close()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
