"""A moto S3 server for the tests that need one (``s3_env``, a fixture through conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from _dist import free_port

BUCKET = "ckpt-test"


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """A moto S3 server on a random loopback port, and the environment that points clients at it."""
    port = free_port()
    handle, recording = tempfile.mkstemp(prefix="moto-recording-")  # see `recorded`
    os.close(handle)
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, MOTO_RECORDER_FILEPATH=recording),
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail("moto server did not start")
            time.sleep(0.1)
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": endpoint,
        "CKPTOOLS_TEST_MOTO_RECORDING": recording,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir(BUCKET)
    try:
        yield env
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.kill()
        server.wait()
        os.unlink(recording)


@contextmanager
def recorded() -> Iterator[list[dict]]:
    """The requests the server received within the block, as moto's recorder writes them (method,
    url, headers), to tell from the server's side which client sent what: a rank names itself in
    its User-Agent with ``AWS_SDK_UA_APP_ID=rankN`` (botocore adds ``app/rankN``)."""
    import json

    endpoint, path = os.environ["AWS_ENDPOINT_URL_S3"], os.environ["CKPTOOLS_TEST_MOTO_RECORDING"]
    for call in ("reset-recording", "start-recording"):
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/recorder/{call}", method="POST"))
    requests: list[dict] = []
    try:
        yield requests
    finally:
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/recorder/stop-recording", method="POST"))
        with open(path) as f:
            for line in f:
                entry = json.loads(line)
                entry.pop("body", None)
                requests.append(entry)
