"""A byte relay between a TCP address and a unix socket, one thread pair per connection, half-closes passed on: how an
agent CLI inside a `--network none` container reaches kiln's endpoint and nothing else.

    python3 relay.py tcp:127.0.0.1:8080 unix:/run/kiln/api.sock --ready /tmp/kiln-relay.ready

On the host, harness_agent.py relays a unix socket in a folder of its own to the endpoint's TCP port and mounts that
folder into the container; in the container this script (run by the image's python3, standard library only, Python
3.6 and later) listens on the container's loopback, where the CLI's base URL points, and relays to that socket. The
container has no network interface but `lo`: the socket is its only way out.
"""
import argparse
import os
import socket
import threading

CHUNK = 65536


def address(spec):
    """("tcp", (host, port)) or ("unix", path) from "tcp:HOST:PORT" or "unix:PATH"."""
    kind, _, rest = spec.partition(":")
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        return kind, (host, int(port))
    if kind == "unix":
        return kind, rest
    raise ValueError("{}: expected tcp:HOST:PORT or unix:PATH".format(spec))


def listen(spec):
    """A listening socket at the address `spec` names (a unix socket is made connectable by anyone in the container:
    the CLI may run as another user)."""
    kind, where = address(spec)
    server = socket.socket(socket.AF_INET if kind == "tcp" else socket.AF_UNIX, socket.SOCK_STREAM)
    if kind == "tcp":
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(where)
    if kind == "unix":
        os.chmod(where, 0o777)
    server.listen(64)
    return server


def connect(spec):
    kind, where = address(spec)
    if kind == "tcp":
        return socket.create_connection(where)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(where)
    return client


def pump(source, sink):
    """Copy until `source` closes its side, then close that side of `sink` (HTTP clients half-close)."""
    try:
        while True:
            data = source.recv(CHUNK)
            if not data:
                break
            sink.sendall(data)
    except OSError:  # either end reset the connection: nothing more to copy
        pass
    finally:
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:  # the sink is already closed
            pass


def relay(client, target):
    try:
        upstream = connect(target)
    except OSError:
        client.close()
        return
    threads = [threading.Thread(target=pump, args=pair, daemon=True)
               for pair in ((client, upstream), (upstream, client))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    client.close()
    upstream.close()


def serve(server, target):
    """Relay every connection `server` accepts to `target` until `server` is closed."""
    while True:
        try:
            client, _ = server.accept()
        except OSError:  # closed
            return
        threading.Thread(target=relay, args=(client, target), daemon=True).start()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("listen", help="tcp:HOST:PORT or unix:PATH to listen on")
    parser.add_argument("target", help="tcp:HOST:PORT or unix:PATH to relay each connection to")
    parser.add_argument("--ready", help="a file created once listening")
    args = parser.parse_args()
    server = listen(args.listen)
    if args.ready:
        open(args.ready, "w").close()
    serve(server, args.target)


if __name__ == "__main__":
    main()
