"""An S3 endpoint on this machine for the tests: moto's server, a real HTTP server that
speaks the S3 protocol, so pyarrow's S3FileSystem (what raylm uses for ``s3://``) runs
unchanged, from the driver and from Ray's worker processes alike."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import pyarrow.fs as pafs

BUCKET = "raylm-test"
# moto takes any credentials; they travel in the URI (pyarrow's user-info form), so that
# Ray's workers, started before the test, need no environment of their own.
KEY, SECRET = "test", "test"
REGION = "us-east-1"


class S3Endpoint:
    def __init__(self, host: str, port: int):
        self.address = f"{host}:{port}"
        self.query = f"endpoint_override={host}:{port}&scheme=http&region={REGION}"
        self.fs = pafs.S3FileSystem(access_key=KEY, secret_key=SECRET, scheme="http",
                                    endpoint_override=f"{host}:{port}", region=REGION,
                                    allow_bucket_creation=True)

    def uri(self, key: str) -> str:
        """``s3://`` URI of ``key`` in the test bucket, as a user would pass it."""
        return f"s3://{KEY}:{SECRET}@{BUCKET}/{key.strip('/')}?{self.query}"

    def put(self, key: str, data: bytes) -> None:
        with self.fs.open_output_stream(f"{BUCKET}/{key}") as f:
            f.write(data)

    @contextlib.contextmanager
    def checking_credentials(self):
        """Requests need the credentials of a user the server knows (none here) while
        the block runs: moto's own switch (POST /moto-api/reset-auth)."""
        import urllib.request

        def reset(count: bytes) -> None:
            urllib.request.urlopen(urllib.request.Request(
                f"http://{self.address}/moto-api/reset-auth", data=count, method="POST",
                headers={"Content-Type": "text/plain"}))
        reset(b"0")
        try:
            yield
        finally:
            reset(b"inf")

    def keys(self, prefix: str) -> list[str]:
        selector = pafs.FileSelector(f"{BUCKET}/{prefix}", recursive=True,
                                     allow_not_found=True)
        return sorted(i.path[len(BUCKET) + 1:] for i in self.fs.get_file_info(selector)
                      if i.type == pafs.FileType.File)


@contextlib.contextmanager
def s3_endpoint() -> Iterator[S3Endpoint]:
    """A fresh, empty S3 endpoint (one bucket) on a free local port; stopped on exit.
    (moto keeps its buckets in the process, shared by its servers: the bucket is emptied
    on the way in and out.)"""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = None
    try:
        endpoint = S3Endpoint(*server.get_host_and_port())
        endpoint.fs.create_dir(BUCKET)
        endpoint.fs.delete_dir_contents(BUCKET)
        yield endpoint
    finally:
        if endpoint is not None:
            endpoint.fs.delete_dir_contents(BUCKET, missing_dir_ok=True)
        server.stop()
