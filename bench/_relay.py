"""A minimal TCP pass-through relay: the cost floor of any Python proxy on this machine.

It parses nothing: each client connection gets its own backend connection and bytes
are copied both ways. What a real proxy adds on top of this is its own work. With several
``--backend-port``, the client connections take the backends in turn.

    python bench/_relay.py --port 31000 --backend-port 30000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def serve(port: int, backend_ports: list[int]) -> None:
    turn = itertools.cycle(backend_ports)

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        backend_r, backend_w = await asyncio.open_connection("127.0.0.1", next(turn))
        await asyncio.gather(_pipe(client_r, backend_w), _pipe(backend_r, client_w))

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend-port", type=int, action="append", required=True)
    args = p.parse_args()
    try:
        import uvloop

        uvloop.run(serve(args.port, args.backend_port))
    except ImportError:
        asyncio.run(serve(args.port, args.backend_port))


if __name__ == "__main__":
    main()
