"""Code that runs in the helper processes :mod:`benchmarks.netem` starts inside namespaces.

``python helpers.py KIND ARGS...`` (built by :func:`benchmarks.netem.measure.helper_argv`):

* ``_tcp-sink WARMUP``: listen on all addresses, print the port, receive one stream, print its
  goodput after the warm-up as JSON;
* ``_tcp-source ADDRESS PORT SECONDS``: send zeros to ``ADDRESS:PORT`` for ``SECONDS``;
* ``_rendezvous PLAN_JSON``: Horovod's RendezvousServer for the slot plan, until stdin closes.

It is run by file path, not imported from the package, so it imports nothing from this project:
the standard library only, and Horovod for the rendezvous server.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time

__all__ = ["main"]


def _tcp_sink(warmup: float) -> int:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen(1)
    sys.stdout.write(f"{srv.getsockname()[1]}\n")
    sys.stdout.flush()
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    total = 0
    t_first = t_mark = t_last = 0.0
    bytes_at_mark = -1
    while True:
        n = conn.recv_into(buf)
        now = time.perf_counter()
        if n == 0:
            break
        if total == 0:
            t_first = now
        if bytes_at_mark < 0 and now - t_first >= warmup:
            t_mark, bytes_at_mark = now, total  # count only what arrives after the warm-up
        total += n
        t_last = now
    conn.close()
    srv.close()
    if bytes_at_mark < 0 or t_last <= t_mark:
        t_mark, bytes_at_mark = t_first, 0
    span = max(t_last - t_mark, 1e-9)
    sys.stdout.write(json.dumps({"bits_per_s": (total - bytes_at_mark) * 8 / span,
                                 "bytes": total, "seconds": span}) + "\n")
    return 0


def _tcp_source(address: str, port: int, seconds: float) -> int:
    sock = socket.create_connection((address, port), timeout=30)
    chunk = memoryview(bytes(1 << 20))
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        sock.sendall(chunk)
    sock.shutdown(socket.SHUT_WR)
    sock.settimeout(60)
    while sock.recv(65536):  # wait until the receiver has everything and closes
        pass
    sock.close()
    return 0


def _serve_rendezvous(plan_json: str) -> int:
    """Helper process: Horovod's RendezvousServer for ``plan`` until stdin closes."""
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousServer

    plan = [SlotInfo(**slot) for slot in json.loads(plan_json)]
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(plan)
    sys.stdout.write(f"{port}\n")
    sys.stdout.flush()
    with contextlib.suppress(KeyboardInterrupt):
        sys.stdin.read()  # EOF when the launcher closes the pipe or dies
    server.stop()
    return 0



def main(argv: list[str]) -> int:
    """Entry point of the helper processes this module starts inside namespaces."""
    kind, args = argv[0], argv[1:]
    if kind == "_tcp-sink":
        return _tcp_sink(float(args[0]))
    if kind == "_tcp-source":
        return _tcp_source(args[0], int(args[1]), float(args[2]))
    if kind == "_rendezvous":
        return _serve_rendezvous(args[0])
    raise SystemExit(f"unknown helper {kind!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
