"""Inside a scaffold's sandbox: the run's gateway on the sandbox's own loopback, then the
scaffold. Standard library only: it runs with the scaffold's interpreter, inside the
sandbox, where gyre itself is not installed.

    python sandbox_gateway.py --port P --socket /run/gyre/gateway.sock -- COMMAND...

The sandbox has its own network namespace with only a loopback device: nothing outside
it is reachable, not the engines, the control server, the rendezvous store or anyone
else. This process listens on 127.0.0.1:P there and relays each connection, byte for
byte, to the gateway's Unix socket (bind-mounted into the sandbox), so the scaffold's
OPENAI_BASE_URL `http://127.0.0.1:P/runs/<run_id>/v1` is the one place it can reach; the
run's key decides what it may do there. It then runs COMMAND (the scaffold) and exits
with its exit status.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def _relay(client: socket.socket, path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
    back.start()
    _pipe(client, upstream)
    back.join()
    client.close()
    upstream.close()


def serve(server: socket.socket, path: str) -> None:
    while True:
        client, _ = server.accept()
        threading.Thread(target=_relay, args=(client, path), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command after --")
    server = socket.create_server(("127.0.0.1", args.port))
    threading.Thread(target=serve, args=(server, args.socket), daemon=True).start()
    try:
        return subprocess.call(command)
    except OSError as exc:
        print(f"sandbox_gateway: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
