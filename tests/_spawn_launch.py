"""Launch an ``mp.spawn`` script as a container's first process would be, and report how every process ended.

    python _spawn_launch.py SIGNAL AFTER_LINE -- python SCRIPT ARGS...

This process is a subreaper (``PR_SET_CHILD_SUBREAPER``): the workers, orphaned when their parent dies,
are reparented to it and it reaps them, so their exit statuses are seen (as a container's init sees
them). SIGNAL (a number, 0 for none) is sent to the parent once it printed a line starting with
AFTER_LINE. Prints one JSON line: the parent's and the workers' exit statuses, stdout and stderr.
"""

import ctypes
import json
import os
import re
import subprocess
import sys
import threading
import time


def main() -> None:
    signum, after = int(sys.argv[1]), sys.argv[2]
    cmd = sys.argv[sys.argv.index("--") + 1 :]
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    out = []
    for line in proc.stdout:
        out.append(line)
        if signum and line.startswith(after):
            os.kill(proc.pid, signum)
            signum = 0
    proc.wait()
    reader.join(60)
    text = "".join(out)
    workers = {int(p) for p in re.findall(r"pid (\d+)\]", text)}
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + 60
    while workers - set(statuses) and time.monotonic() < deadline:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.05)
            continue
        if pid in workers:
            statuses[pid] = os.waitstatus_to_exitcode(status)
    print(json.dumps({"parent": proc.returncode, "workers": sorted(statuses.values()), "stdout": text,
                      "stderr": "".join(err)}))  # fmt: skip


if __name__ == "__main__":
    main()
