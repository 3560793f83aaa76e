"""The launcher's end of the rendezvous channel (``channel.py`` has the wire format and the ranks' end): the
server that ``python -m epjit.launch`` runs on 127.0.0.1 for the ranks it starts, one thread per connected rank,
matching the requests of one step on every rank and answering each with the step's result."""

from __future__ import annotations

import contextlib
import hmac
import json
import socket
import threading
from dataclasses import dataclass, field

from . import channel as ch


@dataclass
class _Round:
    """The requests of one collective step (equal ``seq`` on every rank)."""

    entries: dict[int, tuple[int, bool, int, bytearray]] = field(default_factory=dict)
    reply: list[bytes | bytearray] | None = None
    waiting: int = 0


class RendezvousServer:
    """Collectives for n ranks over TCP on 127.0.0.1. Threads: one accepting, one per connected rank."""

    def __init__(self, n: int, token: str) -> None:
        self.n = n
        self._token = token
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))  # port 0: the kernel picks a free port, no race with other jobs
        self._listener.listen(max(n, 16))
        self.addr = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._cond = threading.Condition()
        self._conns: dict[int, socket.socket] = {}
        self._seen: set[int] = set()  # ranks that connected once (a rank never connects twice)
        self._gone: dict[int, str] = {}  # rank -> why it can no longer take part
        self._rounds: dict[int, _Round] = {}
        self._stopping = False
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        t = threading.Thread(target=self._accept_loop, name="epjit-launch-accept", daemon=True)
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        """Stop serving: ranks still connected see the connection close (CollectiveError on their side)."""
        with self._cond:
            self._stopping = True
            conns = list(self._conns.values())
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def rank_exited(self, rank: int, how: str) -> None:
        """Called by the launcher when a rank's process has ended (covers ranks that never connected)."""
        with self._cond:
            # The exit code says more than the generic "disconnected" that the end of its stream left here.
            if rank not in self._gone or self._gone[rank].startswith("disconnected"):
                self._gone[rank] = how
            self._cond.notify_all()

    # -- connections --------------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), name="epjit-launch-conn", daemon=True)
            t.start()

    def _handshake(self, conn: socket.socket) -> int | None:
        conn.settimeout(10.0)  # a stranger that connects and says nothing does not hold a thread for ever
        body = ch.recv_frame(conn)
        if body is None or len(body) < ch.REQUEST.size:
            return None
        op = body[0]
        try:
            hello = json.loads(bytes(body[ch.REQUEST.size :]))
            token, rank, size = str(hello["token"]), int(hello["rank"]), int(hello["size"])
        except (ValueError, KeyError, TypeError):
            return None
        if op != ch.HELLO or not hmac.compare_digest(token.encode(), self._token.encode()):
            ch.send_frame(conn, *ch.encode_error("bad token"))
            return None
        problem = None
        if hello.get("version") != ch.PROTOCOL_VERSION:
            problem = f"protocol version {hello.get('version')} (the launcher speaks {ch.PROTOCOL_VERSION})"
        elif size != self.n:
            problem = f"rank {rank} thinks the world has {size} ranks, the launcher started {self.n}"
        elif not 0 <= rank < self.n:
            problem = f"rank {rank} is out of range for {self.n} ranks"
        with self._cond:
            if problem is None and rank in self._seen:
                problem = (
                    f"rank {rank} is already connected (or was): a process may join the launcher's channel only "
                    "once, and child processes of a rank cannot init epjit as that rank"
                )
            if problem is None:
                self._seen.add(rank)
                self._conns[rank] = conn
        if problem is not None:
            ch.send_frame(conn, *ch.encode_error(problem))
            return None
        ch.send_frame(conn, *ch.encode_ok([]))
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return rank

    def _serve(self, conn: socket.socket) -> None:
        rank = None
        why = "disconnected (its process exited or closed the connection)"
        try:
            rank = self._handshake(conn)
            if rank is None:
                return
            while True:
                body = ch.recv_frame(conn)
                if body is None:
                    return
                if len(body) < ch.REQUEST.size:
                    raise ch.ProtocolError(f"request of {len(body)} bytes")
                op, valid, seq, root = ch.REQUEST.unpack_from(body, 0)
                if op not in (ch.ALLGATHER, ch.BCAST, ch.BARRIER, ch.CLOSE):
                    raise ch.ProtocolError(f"unknown operation {op}")
                payload = body[ch.REQUEST.size :]
                reply = self._collective(rank, op, bool(valid), seq, root, payload)
                ch.send_frame(conn, *reply)
        except ch.ProtocolError as e:
            why = f"broke the channel protocol ({e})"
        except OSError as e:
            why = f"disconnected ({e})"
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            if rank is not None:
                with self._cond:
                    self._conns.pop(rank, None)
                    self._gone.setdefault(rank, why)
                    self._cond.notify_all()

    # -- collectives --------------------------------------------------------------------------------------------

    def _collective(
        self, rank: int, op: int, valid: bool, seq: int, root: int, payload: bytearray
    ) -> list[bytes | bytearray]:
        with self._cond:
            rnd = self._rounds.setdefault(seq, _Round())
            rnd.entries[rank] = (op, valid, root, payload)
            rnd.waiting += 1
            if len(rnd.entries) == self.n and rnd.reply is None:
                rnd.reply = self._resolve(seq, rnd)
                self._cond.notify_all()
            while rnd.reply is None:
                absent = self._absent(rnd)
                if absent is not None:
                    rnd.reply = ch.encode_error(f"{absent} while this rank waited in {ch.OP_NAMES[op]} #{seq}")
                    rnd.entries.clear()  # drop the payloads now; the ranks that are still here get the error
                    self._cond.notify_all()
                    break
                self._cond.wait()
            reply = rnd.reply
            rnd.waiting -= 1
            if rnd.waiting == 0 and self._rounds.get(seq) is rnd:
                del self._rounds[seq]
            return reply

    def _absent(self, rnd: _Round) -> str | None:
        """Why the round can never complete, or None while every missing rank may still come."""
        if self._stopping:
            return "the launcher is shutting down"
        for r in range(self.n):
            if r in rnd.entries:
                continue
            if r in self._gone:
                return f"rank {r} {self._gone[r]}"
        return None

    def _resolve(self, seq: int, rnd: _Round) -> list[bytes | bytearray]:
        calls = {r: (op, root) for r, (op, _, root, _) in rnd.entries.items()}
        if len(set(calls.values())) > 1:

            def name(op: int, root: int) -> str:
                return f"bcast(root={root})" if op == ch.BCAST else ch.OP_NAMES[op]

            names = [name(*calls[r]) for r in range(self.n)]
            runs, start = [], 0
            for r in range(1, self.n + 1):
                if r == self.n or names[r] != names[start]:
                    who = f"rank {start}" if start == r - 1 else f"ranks {start}-{r - 1}"
                    runs.append(f"{who}: {names[start]}")
                    start = r
            listing = ", ".join(runs)
            return ch.encode_error(f"the ranks called different collectives as step #{seq}: {listing}")
        op, root = calls[0]
        if op == ch.ALLGATHER:
            entries = [rnd.entries[r][3] if rnd.entries[r][1] else None for r in range(self.n)]
            # Join once; the same reply bytes go to every rank.
            reply: list[bytes | bytearray] = [b"".join(ch.encode_ok(entries))]
        elif op == ch.BCAST:
            if not 0 <= root < self.n:
                return ch.encode_error(f"bcast root {root} is out of range for {self.n} ranks")
            _, valid, _, data = rnd.entries[root]
            reply = ch.encode_ok([data if valid else None])
        else:  # barrier, close
            reply = ch.encode_ok([])
        rnd.entries.clear()
        return reply
