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
from collections.abc import Iterable
from typing import Generic, TypeVar

import msgspec

from tether.wire.errors import FrameError

__all__ = [
    "MAX_FRAME",
    "Channel",
    "FrameSplitter",
    "FrameTooLarge",
    "decode_frame",
    "encode_frame",
    "framed",
]

MAX_FRAME = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")

In = TypeVar("In")


class FrameTooLarge(FrameError):
    """The peer announced a frame over the cap: the stream can no longer be trusted."""


def framed(payloads: Iterable[bytes]) -> bytes:
    """``payloads`` as one run of frames on the wire (header, payload, header, ...)."""
    return b"".join(_HEADER.pack(len(p)) + p for p in payloads)


def encode_frame(
    encoder: msgspec.msgpack.Encoder, frame: msgspec.Struct, max_frame: int = MAX_FRAME
) -> bytes:
    """``frame``'s payload; FrameError if it is over the cap (nothing is sent then)."""
    return _within_cap(encoder.encode(frame), max_frame)


def _within_cap(payload: bytes, max_frame: int) -> bytes:
    if len(payload) > max_frame:
        raise FrameError(f"frame of {len(payload)} bytes is over the {max_frame}-byte cap")
    return payload


def decode_frame(decoder: msgspec.msgpack.Decoder[In], payload: bytes) -> In:
    """One frame's payload, typed; FrameError if it does not decode, for any reason."""
    try:
        return decoder.decode(payload)
    except Exception as exc:  # DecodeError, and RecursionError for deep nesting, ...
        detail = exc if isinstance(exc, msgspec.DecodeError) else repr(exc)
        raise FrameError(f"undecodable frame of {len(payload)} bytes: {detail}") from None


class FrameSplitter:
    """Frames out of a byte stream read in pieces (a non-blocking reader's): ``feed``
    what arrived, get each whole frame's payload; ``end`` says what an end of stream
    cut short, if anything."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self._max = max_frame

    def feed(self, data: bytes | memoryview) -> tuple[list[bytes], FrameTooLarge | None]:
        """The payloads ``data`` completes, in order, and the error that stopped the
        split: a length over the cap after them (the stream can no longer be trusted:
        feed no more)."""
        buf = self._buf
        buf += data
        out: list[bytes] = []
        error: FrameTooLarge | None = None
        at = 0
        while len(buf) - at >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buf, at)
            if length > self._max:
                error = FrameTooLarge(f"frame of {length} bytes is over the {self._max}-byte cap")
                break
            end = at + _HEADER.size + length
            if end > len(buf):
                break
            out.append(bytes(buf[at + _HEADER.size : end]))
            at = end
        if at:
            del buf[:at]
        return out, error

    def end(self) -> FrameError | None:
        """At the end of the stream: the error of a frame cut short, or None (clean)."""
        if not self._buf:
            return None
        if len(self._buf) < _HEADER.size:
            return FrameError(f"frame cut short: {len(self._buf)} of {_HEADER.size} header bytes")
        (length,) = _HEADER.unpack_from(self._buf, 0)
        got = len(self._buf) - _HEADER.size
        return FrameError(f"frame cut short: {got} of {length} bytes")


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
        return encode_frame(self._encoder, frame, self._max)

    def send_bytes(self, *payloads: bytes) -> None:
        """Encoded frames, written whole and together (one ``sendall``)."""
        data = framed(_within_cap(p, self._max) for p in payloads)
        with self._send_lock:
            self.sock.sendall(data)

    def recv(self) -> In:
        """The next frame. EOFError at a clean end (between frames); FrameError for a
        bad frame, a frame cut short included."""
        return decode_frame(self._decoder, self.recv_bytes())

    def recv_bytes(self) -> bytes:
        """The next frame's payload, undecoded (for a relay that passes it on); raises
        as ``recv`` does, but for a payload that does not decode."""
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
        return payload

    def close(self) -> None:
        self._reader.close()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
