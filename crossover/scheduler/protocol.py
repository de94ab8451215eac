"""Wire protocol between crossover scheduler clients and the node-local daemon.

A frame is a 4-byte big-endian length ``N`` (1 <= N <= :data:`MAX_MESSAGE`) followed by ``N`` bytes of
UTF-8 JSON holding one object. Every object has an ``"op"`` and exactly the fields its op lists in
:data:`CLIENT_OPS` (client to daemon) or :data:`SERVER_OPS` (daemon to client), with exactly those
types: no missing, extra or duplicate keys, no NaN/Infinity, booleans are not integers, integers lie
in ``[0, 2**53)``, numbers are finite and ``>= 0`` (the weight in ``[1e-3, 1e3]``), strings are
1..:data:`MAX_STR` printable characters. Anything else raises :class:`ProtocolError`; the daemon then
closes that one connection.

Conversation (see docs/scheduler.md)::

    client                                   daemon
    hello {v, job, member, weight, pid}  ->
                                         <-  welcome {v, pid, lease}
    acquire {id, dev, seq}               ->
                                         <-  grant {id, dev, turn, waited_us}     (when it is our turn)
    release {dev}                        ->                                        (no reply)
    ping {id}                            ->
                                         <-  pong {id}
    status {id}                          ->
                                         <-  status {id, state}
                                         <-  error {msg}                           (then the daemon closes)
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

from crossover.scheduler.settings import WEIGHT, SettingError

__all__ = ["VERSION", "MAX_MESSAGE", "MAX_STR", "CLIENT_OPS", "SERVER_OPS", "ProtocolError", "encode",
           "Decoder", "validate"]

VERSION = 1
MAX_MESSAGE = 4096
MAX_STR = 200
MAX_INT = 2 ** 53
HEADER = struct.Struct("!I")

# op -> {field: type}; float fields accept JSON integers too.
CLIENT_OPS: dict[str, dict[str, type]] = {
    "hello": {"v": int, "job": str, "member": str, "weight": float, "pid": int},
    "acquire": {"id": int, "dev": str, "seq": int},
    "release": {"dev": str},
    "ping": {"id": int},
    "status": {"id": int},
}
SERVER_OPS: dict[str, dict[str, type]] = {
    "welcome": {"v": int, "pid": int, "lease": float},
    "grant": {"id": int, "dev": str, "turn": int, "waited_us": int},
    "pong": {"id": int},
    "status": {"id": int, "state": dict},
    "error": {"msg": str},
}
MIN_WEIGHT, MAX_WEIGHT = WEIGHT.lo, WEIGHT.hi
_MAX_ERROR = 1000


class ProtocolError(ValueError):
    """A frame or message that breaks the protocol."""


def _check_str(op: str, key: str, value: str) -> None:
    limit = _MAX_ERROR if (op, key) == ("error", "msg") else MAX_STR
    if not 1 <= len(value) <= limit:
        raise ProtocolError(f"{op}.{key}: string of length {len(value)} (allowed 1..{limit})")
    if not value.isprintable():
        raise ProtocolError(f"{op}.{key}: non-printable characters")


def _check_field(op: str, key: str, kind: type, value: Any) -> None:
    if kind is int:
        if type(value) is not int:
            raise ProtocolError(f"{op}.{key}: expected an integer, got {type(value).__name__}")
        if not 0 <= value < MAX_INT:
            raise ProtocolError(f"{op}.{key}: integer out of range")
    elif kind is float:
        if type(value) is int:  # compared as an integer: float() of a 400-digit one raises OverflowError
            if not 0 <= value < MAX_INT:
                raise ProtocolError(f"{op}.{key}: number out of range (allowed 0..2**53)")
        elif type(value) is float:
            if not math.isfinite(value) or value < 0:
                raise ProtocolError(f"{op}.{key}: number must be finite and >= 0")
        else:
            raise ProtocolError(f"{op}.{key}: expected a number, got {type(value).__name__}")
    elif kind is str:
        if type(value) is not str:
            raise ProtocolError(f"{op}.{key}: expected a string, got {type(value).__name__}")
        _check_str(op, key, value)
    elif kind is dict:
        if type(value) is not dict:
            raise ProtocolError(f"{op}.{key}: expected an object, got {type(value).__name__}")
    else:  # pragma: no cover - schema bug
        raise AssertionError(kind)


def validate(msg: Any, ops: dict[str, dict[str, type]]) -> dict[str, Any]:
    """Return ``msg`` if it is a valid message of one of ``ops``, else raise :class:`ProtocolError`."""
    if type(msg) is not dict:
        raise ProtocolError(f"message must be a JSON object, not {type(msg).__name__}")
    op = msg.get("op")
    if type(op) is not str or op not in ops:
        raise ProtocolError(f"unknown op {op!r}" if type(op) is str else "missing or non-string op")
    schema = ops[op]
    keys = set(msg) - {"op"}
    if keys != set(schema):
        missing, extra = sorted(set(schema) - keys), sorted(keys - set(schema))
        raise ProtocolError(f"{op}: missing fields {missing}, unexpected fields {extra}")
    for key, kind in schema.items():
        _check_field(op, key, kind, msg[key])
    if op == "hello":
        if msg["v"] != VERSION:
            raise ProtocolError(f"hello: protocol version {msg['v']} (this daemon speaks {VERSION})")
        try:
            WEIGHT.parse(msg["weight"], "hello: weight")
        except SettingError as exc:
            raise ProtocolError(str(exc)) from None
    return msg


def encode(msg: dict[str, Any], ops: dict[str, dict[str, type]] | None = None) -> bytes:
    """One frame for ``msg`` (validated against ``ops`` when given)."""
    if ops is not None:
        validate(msg, ops)
    try:
        body = _ENCODER.encode(msg).encode("utf-8")
    except (ValueError, TypeError) as exc:  # NaN/Infinity or a non-JSON value: a bug of the sender
        raise ProtocolError(f"cannot encode {msg.get('op')!r}: {exc}") from None
    if len(body) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    return HEADER.pack(len(body)) + body


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ProtocolError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not allowed")


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)


def _parse(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"frame is not UTF-8: {exc}") from None
    try:
        return _DECODER.decode(text)
    except RecursionError:
        raise ProtocolError("JSON nested too deeply") from None
    except ProtocolError:
        raise
    except ValueError as exc:  # JSONDecodeError, or an integer past Python's digit limit
        raise ProtocolError(f"invalid JSON: {exc}") from None


class Decoder:
    """Incremental frame decoder for one connection: :meth:`feed` bytes, get validated messages.

    After a :class:`ProtocolError` the stream is out of sync; the caller must close the connection.
    """

    def __init__(self, ops: dict[str, dict[str, type]]) -> None:
        self.ops = ops
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Add received bytes; return every complete message, in order."""
        self._buf += data
        out = []
        while len(self._buf) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buf)
            if not 1 <= length <= MAX_MESSAGE:
                raise ProtocolError(f"frame length {length} (allowed 1..{MAX_MESSAGE})")
            if len(self._buf) < HEADER.size + length:
                break
            body = bytes(self._buf[HEADER.size:HEADER.size + length])
            del self._buf[:HEADER.size + length]
            out.append(validate(_parse(body), self.ops))
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buf)
