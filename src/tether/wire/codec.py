"""Length-prefixed framing over a stream socket, with a size cap.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack. A payload
that fails to decode was read whole, so the stream stays in step and the reader carries
on; a length over the cap means the peer is broken, and the channel must be closed.
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

    def send_bytes(self, payload: bytes) -> None:
        if len(payload) > self._max:
            raise FrameError(f"frame of {len(payload)} bytes is over the {self._max}-byte cap")
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(payload)) + payload)

    def recv(self) -> In:
        """The next frame. EOFError at a clean end; FrameError for a bad frame."""
        header = self._reader.read(_HEADER.size)
        if len(header) < _HEADER.size:
            raise EOFError
        (length,) = _HEADER.unpack(header)
        if length > self._max:
            raise FrameTooLarge(f"frame of {length} bytes is over the {self._max}-byte cap")
        payload = self._reader.read(length)
        if len(payload) < length:
            raise EOFError
        try:
            return self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise FrameError(f"undecodable frame of {length} bytes: {exc}") from None

    def close(self) -> None:
        self._reader.close()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
