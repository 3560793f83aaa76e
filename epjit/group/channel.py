"""The local launcher's rendezvous channel: wire format, the client that each rank uses, and the transport of the
``"launcher"`` backend over it.

``python -m epjit.launch`` runs the server (``rendezvous.py``); every rank it starts connects once, over TCP on
127.0.0.1, and runs its collectives through it. Nothing here imports more than the standard library and epjit's
settings and errors: a rank started by the launcher never imports MPI.

Wire format (integers big-endian)::

    frame    = u64 length | `length` bytes
    request  = u8 op | u8 valid | i64 seq | i32 root | payload        (op: HELLO, ALLGATHER, BCAST, BARRIER, CLOSE)
    reply    = u8 status | body
                 status OK:    u32 count | count x (i64 length | bytes)    (length -1: that rank's input was invalid)
                 status ERROR: utf-8 message
    hello    = a request with op HELLO and a JSON payload {"version", "token", "rank", "size", "pid"}

``valid`` = 0 means "this rank's argument was bad": the rank still takes part, so that nobody waits for it, and
every rank learns which rank it was. ``seq`` counts the collectives of one rank; the server matches requests with
equal ``seq`` and checks that every rank called the same operation.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Mapping

from .. import env
from ..errors import SetupError
from .transport import ChannelFailure, Placement, Transport, int_var

PROTOCOL_VERSION = 1

HELLO, ALLGATHER, BCAST, BARRIER, CLOSE = 1, 2, 3, 4, 5
OP_NAMES = {HELLO: "hello", ALLGATHER: "allgather", BCAST: "bcast", BARRIER: "barrier", CLOSE: "close"}

OK, ERROR = 0, 1

_FRAME = struct.Struct("!Q")
REQUEST = struct.Struct("!BBqi")
_STATUS = struct.Struct("!B")
_COUNT = struct.Struct("!I")
_LENGTH = struct.Struct("!q")

# A frame longer than this is a corrupt stream, not a payload (collectives carry handles and ids, a few MB at most).
MAX_FRAME = 1 << 34


class ProtocolError(Exception):
    """The peer sent something that is not a frame of this protocol."""


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    """Read exactly n bytes; None if the peer closed the stream before the first byte."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 22))
        if k == 0:
            if got == 0:
                return None
            raise ProtocolError(f"stream closed after {got} of {n} bytes")
        got += k
    return buf


def recv_frame(sock: socket.socket) -> bytearray | None:
    """One frame's body; None on a clean end of stream (the peer closed between frames)."""
    head = _recv_exact(sock, _FRAME.size)
    if head is None:
        return None
    (length,) = _FRAME.unpack(head)
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes announced: not an epjit channel stream")
    if length == 0:
        return bytearray()
    body = _recv_exact(sock, length)
    if body is None:
        raise ProtocolError(f"stream closed before a frame of {length} bytes")
    return body


def send_frame(sock: socket.socket, *parts: bytes | bytearray | memoryview) -> None:
    # Parts go out one by one: a payload of several MB is never copied into a joined buffer.
    sock.sendall(_FRAME.pack(sum(len(p) for p in parts)))
    for part in parts:
        if len(part):
            sock.sendall(part)


def encode_ok(entries: list[bytes | bytearray | None]) -> list[bytes | bytearray]:
    """The parts of an OK reply (to be sent with :func:`send_frame`)."""
    parts: list[bytes | bytearray] = [_STATUS.pack(OK) + _COUNT.pack(len(entries))]
    for entry in entries:
        if entry is None:
            parts.append(_LENGTH.pack(-1))
        else:
            parts.append(_LENGTH.pack(len(entry)))
            parts.append(entry)
    return parts


def encode_error(message: str) -> list[bytes]:
    return [_STATUS.pack(ERROR) + message.encode("utf-8", "replace")]


def decode_reply(body: bytearray) -> list[bytes | None]:
    """The entries of a reply; raises ChannelFailure (not fatal) with the server's message for an ERROR reply."""
    view = memoryview(body)
    if len(view) < _STATUS.size:
        raise ProtocolError("empty reply")
    (status,) = _STATUS.unpack_from(view, 0)
    if status == ERROR:
        raise ChannelFailure(bytes(view[1:]).decode("utf-8", "replace"), fatal=False)
    if status != OK:
        raise ProtocolError(f"reply status {status}")
    (count,) = _COUNT.unpack_from(view, 1)
    pos = 1 + _COUNT.size
    out: list[bytes | None] = []
    for _ in range(count):
        (length,) = _LENGTH.unpack_from(view, pos)
        pos += _LENGTH.size
        if length < 0:
            out.append(None)
        else:
            out.append(bytes(view[pos : pos + length]))
            pos += length
    if pos != len(view):
        raise ProtocolError(f"reply has {len(view) - pos} trailing bytes")
    return out


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"launcher address {addr!r} is not host:port")
    return host, int(port)


class Client:
    """One rank's connection to the launcher. Collectives are sequential; one thread at a time."""

    def __init__(self, addr: str, token: str, rank: int, size: int, timeout: float | None) -> None:
        self.addr = addr
        self.rank = rank
        self.size = size
        self._timeout = timeout
        self._seq = 0
        host, port = parse_addr(addr)
        try:
            sock = socket.create_connection((host, port), timeout=30.0)
        except OSError as e:
            raise ChannelFailure(f"cannot connect to the launcher at {addr}: {e}", fatal=True) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # barriers are latency-bound
            hello = {"version": PROTOCOL_VERSION, "token": token, "rank": rank, "size": size, "pid": os.getpid()}
            send_frame(sock, REQUEST.pack(HELLO, 1, 0, rank), json.dumps(hello).encode())
            body = recv_frame(sock)
            if body is None:
                raise ProtocolError("the launcher closed the connection during the handshake")
            decode_reply(body)
        except ChannelFailure as e:
            sock.close()
            raise ChannelFailure(f"the launcher at {addr} refused rank {rank}: {e}", fatal=True) from None
        except (OSError, ProtocolError) as e:
            sock.close()
            raise ChannelFailure(f"handshake with the launcher at {addr} failed: {e}", fatal=True) from None
        sock.settimeout(timeout)
        self._sock: socket.socket | None = sock

    @property
    def usable(self) -> bool:
        return self._sock is not None

    def _abort(self) -> None:
        # After a timeout or a broken stream the next reply could belong to an old request: never reuse the socket.
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _call(self, op: int, valid: bool, root: int, payload: bytes) -> list[bytes | None]:
        if self._sock is None:
            raise ChannelFailure("the connection to the launcher is already broken", fatal=True)
        seq = self._seq
        self._seq += 1
        try:
            send_frame(self._sock, REQUEST.pack(op, int(valid), seq, root), payload)
            body = recv_frame(self._sock)
        except TimeoutError:
            self._abort()
            raise ChannelFailure(
                f"timed out after {self._timeout:g} s waiting for the other ranks (EPJIT_COLLECTIVE_TIMEOUT_S)",
                fatal=True,
            ) from None
        except (OSError, ProtocolError) as e:
            self._abort()
            raise ChannelFailure(f"lost the connection to the launcher at {self.addr} ({e})", fatal=True) from None
        if body is None:
            self._abort()
            raise ChannelFailure(f"the launcher at {self.addr} closed the connection (has it exited?)", fatal=True)
        try:
            return decode_reply(body)
        except ProtocolError as e:
            self._abort()
            raise ChannelFailure(f"bad reply from the launcher: {e}", fatal=True) from None

    def allgather(self, data: bytes | None) -> list[bytes | None]:
        out = self._call(ALLGATHER, data is not None, 0, data or b"")
        if len(out) != self.size:
            raise ChannelFailure(f"allgather reply has {len(out)} entries for {self.size} ranks", fatal=True)
        return out

    def bcast(self, data: bytes | None, root: int) -> bytes | None:
        out = self._call(BCAST, data is not None or self.rank != root, root, data or b"")
        if len(out) != 1:
            raise ChannelFailure(f"bcast reply has {len(out)} entries", fatal=True)
        return out[0]

    def barrier(self) -> None:
        self._call(BARRIER, True, 0, b"")

    def close_group(self) -> None:
        """The collective end of a group (like MPI_Comm_free): a rank that closes while the others wait in another
        collective makes them fail at once ("different collectives") instead of waiting for it.

        The socket stays open, so that a later ``epjit.init()`` in the same process goes on with the next step.
        """
        self._call(CLOSE, True, 0, b"")


class LauncherTransport:
    def __init__(self, client: Client) -> None:
        self._client = client

    def allgather(self, data: bytes | None) -> list[bytes | None]:
        return self._client.allgather(data)

    def bcast(self, data: bytes | None, root: int) -> bytes | None:
        return self._client.bcast(data, root)

    def barrier(self) -> None:
        self._client.barrier()

    def close(self) -> None:
        self._client.close_group()


# This process's connection to epjit.launch (see join).
_client: Client | None = None


def join(environ: Mapping[str, str], timeout: float | None) -> tuple[Transport, Placement]:
    """(transport, placement) of this rank of ``python -m epjit.launch``, from the variables the launcher set."""
    global _client

    def need_int(name: str) -> int:
        value = int_var(environ, name)
        if value is None or value < 0:
            raise SetupError(
                f"{env.LAUNCH_ADDR} is set but {name}={environ.get(name)!r} is not a rank number: "
                "was this process started by `python -m epjit.launch`?"
            )
        return value

    rank, size = need_int(env.RANK), need_int(env.WORLD_SIZE)
    local_rank, local_size = need_int(env.LOCAL_RANK), need_int(env.LOCAL_SIZE)
    addr, token = environ[env.LAUNCH_ADDR], environ.get(env.LAUNCH_TOKEN, "")
    if not (0 <= rank < size and 0 <= local_rank < local_size):
        raise SetupError(
            f"the launcher's variables are inconsistent: {env.RANK}={rank}, {env.WORLD_SIZE}={size}, "
            f"{env.LOCAL_RANK}={local_rank}, {env.LOCAL_SIZE}={local_size}"
        )
    client = _client
    if client is None or not client.usable or (client.addr, client.rank, client.size) != (addr, rank, size):
        try:
            client = Client(addr, token, rank, size, timeout)
        except (ChannelFailure, ValueError) as e:
            raise SetupError(f"rank {rank} cannot join the launcher's channel: {e}") from None
        _client = client  # kept for the life of the process: a later init() after close() reuses it
    return LauncherTransport(client), Placement(rank, size, local_rank, local_size, None)
