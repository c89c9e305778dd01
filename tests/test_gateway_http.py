"""The gateway at the HTTP level: malformed framing, bodies that cannot be decoded and a
compression bomb are each a 4xx, and the gateway goes on serving (a real Gateway on
loopback, raw bytes on a socket; no engine is needed, as none of these reaches one)."""
import asyncio
import zlib

import pytest

from gyre_slurm.gateway.app import Gateway
from gyre_slurm.models import tiny
from gyre_slurm.traj.store import CallStoreWriter

RUN = b"s0000-p000-g00"
CHAT = b"POST /runs/" + RUN + b"/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
JSON = b"Content-Type: application/json\r\n"


def _bomb() -> bytes:
    """1 GiB of zeros, gzipped to about 1 MB."""
    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    return b"".join(co.compress(bytes(1 << 24)) for _ in range(64)) + co.flush()


CASES = {
    "gzip that is not gzip": (JSON + b"Content-Encoding: gzip\r\nContent-Length: 5\r\n\r\nabcde",
                              400),
    "an encoding not served": (JSON + b"Content-Encoding: br\r\nContent-Length: 5\r\n\r\nabcde",
                               400),
    "chunks that are not chunks": (JSON + b"Transfer-Encoding: chunked\r\n\r\nZZ\r\nab\r\n0\r\n\r\n",
                                   400),
    "a length and chunks": (JSON + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                            400),
    "a negative length": (JSON + b"Content-Length: -1\r\n\r\n{}", 400),
    "two lengths": (JSON + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
    "a body shorter than its length": (JSON + b"Content-Length: 500\r\n\r\n{}", 408),
    "a charset that is not UTF-8": (b"Content-Type: application/json; charset=utf-32\r\n"
                                    b"Content-Length: 2\r\n\r\n{}", 400),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_model_dir(tmp_path_factory.mktemp("gw-http") / "m")


async def _status(port: int, data: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    head = await asyncio.wait_for(reader.read(100), 30)
    writer.close()
    return int(head.split(b" ")[1])


def test_malformed_http_is_a_4xx_and_the_gateway_serves_on(model_dir, tmp_path):
    async def main():
        writer = CallStoreWriter(tmp_path / "job", "gateway")
        gw = Gateway(model_dir=model_dir, call_writer=writer, wait_for_server_s=1,
                     body_timeout_s=2)
        port = await gw.start("127.0.0.1", 0)
        try:
            auth = b"Authorization: Bearer " + gw.open_run(RUN.decode()).encode() + b"\r\n"
            got = {name: await _status(port, CHAT + auth + b"Connection: close\r\n" + rest)
                   for name, (rest, _) in CASES.items()}
            bomb = _bomb()
            got["a gzip bomb"] = await _status(
                port, CHAT + auth + JSON + b"Content-Encoding: gzip\r\nContent-Length: "
                + str(len(bomb)).encode() + b"\r\nConnection: close\r\n\r\n" + bomb)
            models = await _status(port, b"GET /runs/" + RUN + b"/v1/models HTTP/1.1\r\n"
                                   b"Host: x\r\n" + auth + b"Connection: close\r\n\r\n")
            return got, models
        finally:
            await gw.stop()
            writer.close()

    got, models = asyncio.run(main())
    assert got == {**{name: status for name, (_, status) in CASES.items()},
                   "a gzip bomb": 413}
    assert models == 200
