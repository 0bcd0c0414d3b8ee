"""moto's S3 server, as ``python -m moto.server`` runs it, that also writes one line per request it
receives (method, path and query, User-Agent, Range; never a body) to ``$CKPTOOLS_TEST_REQUEST_LOG``
while that file exists: the server's own account of which client sent what (tests/_s3.py, `recorded`).

moto's recorder writes each request's body into its file from the server's threads at once, and
parallel uploads' lines interleave there; these lines are written whole, under a lock.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

from moto.moto_server.threaded_moto_server import DomainDispatcherApplication, create_backend_app
from moto.server import MotoRequestHandler
from werkzeug.serving import run_simple

_LOCK = threading.Lock()


def logged(app: Any, log: str) -> Any:
    def middleware(environ: dict[str, Any], start_response: Any) -> Any:
        query = environ.get("QUERY_STRING", "")
        line = {
            "method": environ["REQUEST_METHOD"],
            "url": environ.get("PATH_INFO", "") + (f"?{query}" if query else ""),
            "headers": {"User-Agent": environ.get("HTTP_USER_AGENT", ""), "Range": environ.get("HTTP_RANGE", "")},
        }
        if not line["headers"]["Range"]:
            del line["headers"]["Range"]
        with _LOCK:
            if os.path.exists(log):
                with open(log, "a") as f:
                    f.write(json.dumps(line) + "\n")
        return app(environ, start_response)

    return middleware


if __name__ == "__main__":
    host, port, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ.setdefault("MOTO_PORT", str(port))
    main_app = DomainDispatcherApplication(create_backend_app)
    run_simple(host, port, logged(main_app, log), threaded=True, request_handler=MotoRequestHandler)
