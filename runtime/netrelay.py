"""A transparent TCP relay that delays a namespace's traffic: the delay and jitter this kernel's missing
netem would give.

How it sits in the path: iptables REDIRECTs every TCP connection the namespace opens through its eth0 to
the relay's port (``netfaults.install_redirect``). The relay reads where the connection was going
(``SO_ORIGINAL_DST``), opens its own connection there from the host's own IP (marked, so it is not
redirected again) and copies bytes both ways. A connection crosses two links, the opener's and the
acceptor's, so each chunk read at time t is written at ``t + d(opener) + d(acceptor) ± jitter``, never
before the previous chunk (a stream does not reorder); the delays come from one control file for the
whole cluster, ``{ip: {"delay_ms", "jitter_ms"}}``, so a delay put on a node's link slows every
connection to it, whoever opened it.

Why a process per namespace with threads per connection: the services' connections are long-lived and
pooled (a few per peer), and blocking sockets keep the copy simple and fast. A partner that dies or resets
closes both sides, so a peer sees the failure as it would without the relay. The delays are re-read
every 50 ms (``kvpool chaos delay`` writes them) and apply to open connections too.

Run as ``ip netns exec NS python -m kvpool.runtime.netrelay --control FILE --self-ip IP``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import random
import socket
import struct
import sys
import threading
import time
from pathlib import Path

from kvpool.runtime.lifecycle import print_ready
from kvpool.runtime.netfaults import RELAY_MARK, read_delays

SO_ORIGINAL_DST = 80
CHUNK = 1 << 20
QUEUE_CHUNKS = 64  # back-pressure: at most this many chunks in flight per direction
CONNECT_TIMEOUT_S = 5.0
POLL_S = 0.05


class DelayControl:
    """Every link's delay and jitter (seconds, by IP), refreshed from the control file by a poller thread."""

    def __init__(self, path: Path, self_ip: str) -> None:
        self.path = path
        self.self_ip = self_ip
        self.links: dict[str, tuple[float, float]] = {}
        self._mtime = 0.0
        self.refresh()
        threading.Thread(target=self._poll, daemon=True).start()

    def refresh(self) -> None:
        with contextlib.suppress(OSError):
            mtime = self.path.stat().st_mtime_ns
            if mtime != self._mtime:
                self._mtime = mtime
                self.links = {ip: (d / 1e3, j / 1e3) for ip, (d, j) in read_delays(self.path).items()}

    def _poll(self) -> None:
        while True:
            time.sleep(POLL_S)
            self.refresh()

    def due(self, peer_ip: str, now: float, previous: float) -> float:
        """When a chunk read now on a connection between this host and ``peer_ip`` may be written."""
        d1, j1 = self.links.get(self.self_ip, (0.0, 0.0))
        d2, j2 = self.links.get(peer_ip, (0.0, 0.0))
        jitter = j1 + j2
        spread = random.uniform(-jitter, jitter) if jitter else 0.0
        return max(now + max(d1 + d2 + spread, 0.0), previous)


class Pair:
    """One relayed connection: two directions, each a reader thread and a writer thread."""

    def __init__(
        self, client: socket.socket, upstream: socket.socket, peer_ip: str, control: DelayControl
    ) -> None:
        self.socks = (client, upstream)
        self.peer_ip = peer_ip
        self.control = control
        self._closed = threading.Event()
        for src, dst in ((client, upstream), (upstream, client)):
            q: queue.Queue[tuple[float, bytes | None]] = queue.Queue(QUEUE_CHUNKS)
            threading.Thread(target=self._read, args=(src, q), daemon=True).start()
            threading.Thread(target=self._write, args=(dst, q), daemon=True).start()

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            for s in self.socks:
                reset(s)

    def _read(self, src: socket.socket, q: queue.Queue[tuple[float, bytes | None]]) -> None:
        last = 0.0
        try:
            while True:
                data = src.recv(CHUNK)
                last = self.control.due(self.peer_ip, time.monotonic(), last)
                q.put((last, data or None))
                if not data:
                    return
        except OSError:
            self.close()
            with contextlib.suppress(queue.Full):
                q.put_nowait((0.0, None))

    def _write(self, dst: socket.socket, q: queue.Queue[tuple[float, bytes | None]]) -> None:
        try:
            while True:
                due, data = q.get()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if data is None:
                    if not self._closed.is_set():
                        dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
        except OSError:
            self.close()


def reset(sock: socket.socket) -> None:
    """Close with a RST (zero linger), as a dying peer's kernel would; never raises."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


def original_destination(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, addr = struct.unpack("!2xH4s8x", raw)
    return socket.inet_ntoa(addr), port


def serve(listener: socket.socket, control: DelayControl) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_open, args=(client, control), daemon=True).start()


def _open(client: socket.socket, control: DelayControl) -> None:
    try:
        dest = original_destination(client)
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, RELAY_MARK)
        upstream.settimeout(CONNECT_TIMEOUT_S)
        upstream.connect(dest)
        upstream.settimeout(None)
    except OSError:
        reset(client)
        return
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    Pair(client, upstream, dest[0], control)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpool.runtime.netrelay", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--control", type=Path, required=True, help="JSON {ip: {delay_ms, jitter_ms}} of all links"
    )
    p.add_argument("--self-ip", required=True, help="this host's IP (its own link's delay applies too)")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", args.port))
    listener.listen(512)
    control = DelayControl(args.control, args.self_ip)
    print_ready({"port": listener.getsockname()[1], "pid": os.getpid()})
    with contextlib.suppress(KeyboardInterrupt):
        serve(listener, control)
    return 0


if __name__ == "__main__":
    sys.exit(main())
