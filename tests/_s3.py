"""A moto S3 server for the tests that need one (``s3_env``, a fixture through conftest.py)."""

from __future__ import annotations

import os
import shutil
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
    recording = os.path.join(tempfile.mkdtemp(prefix="moto-requests-"), "requests.jsonl")  # see `recorded`
    server = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "_moto_logged.py"), "127.0.0.1", str(port), recording],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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
        shutil.rmtree(os.path.dirname(recording), ignore_errors=True)


@contextmanager
def recorded() -> Iterator[list[dict]]:
    """The requests the server received within the block (method, url, User-Agent and Range
    headers; tests/_moto_logged.py), to tell from the server's side which client sent what: a rank
    names itself in its User-Agent with ``AWS_SDK_UA_APP_ID=rankN`` (botocore adds ``app/rankN``)."""
    import json

    path = os.environ["CKPTOOLS_TEST_MOTO_RECORDING"]
    open(path, "w").close()  # the server writes while the file exists
    requests: list[dict] = []
    try:
        yield requests
    finally:
        os.rename(path, path + ".done")
        with open(path + ".done") as f:
            requests += [json.loads(line) for line in f]
        os.unlink(path + ".done")
