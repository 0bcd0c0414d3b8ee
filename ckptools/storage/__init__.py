"""The one door to files: local paths and fsspec URLs (``s3://``, ``memory://``, ...).

Paths stay ``str`` throughout, because a URL run through ``pathlib.Path`` loses its ``//``.

===========  ==============================================================================
module       its one job
===========  ==============================================================================
paths.py     a path or URL resolved once (`Location`), joins, listings, temporary names
writes.py    atomic writes: local (temporary file, fsync, rename, directory fsync), S3
             (a streamed multipart upload, completed last), other stores (one PUT or a move)
reads.py     a local file opened once and checked on its descriptor, a remote one fetched once;
             byte ranges copied or CRC-32-checked, progress
checksum.py  CRC-32, through ISA-L where installed (seven times zlib's speed)
private.py   folders only this user can change (node memory in a folder every local user shares)
in_flight.py writes in flight in this process, by path: whoever resolves the path waits for them
leftovers.py which temporaries a writer that is gone left behind
processes.py whether a process runs, when it started, whether it is this user's
===========  ==============================================================================

Everything else imports from this package, never from its modules.
"""

from __future__ import annotations

from .checksum import FAST_CRC32, crc32
from .in_flight import announce as announce_write
from .in_flight import wait_for as wait_for_write
from .leftovers import STALE_TMP_SECONDS, abandoned_tmps, is_abandoned_tmp
from .paths import (
    TMP_MARKER,
    Location,
    PathLike,
    file_size,
    fresh_tmp,
    fspath,
    fsync_dir,
    get_filesystem,
    host,
    is_local,
    is_object_store,
    join,
    list_files,
    remove,
    resolve,
    tmp_name,
)
from .private import make_private, owner_name, private_problem
from .processes import pid_alive, process_of_mine, process_start
from .reads import (
    NODE_MARK,
    RANGE_BYTES,
    RANGES_AT_ONCE,
    copy_range,
    crc32_range,
    mapped_path,
    open_for_read,
    open_local,
    pinned,
    progress_hook,
    ranged_reads,
    report_progress,
)
from .writes import UPLOAD_PART, atomic_write, local_target, publish, streams_multipart

__all__ = [
    "FAST_CRC32",
    "NODE_MARK",
    "RANGES_AT_ONCE",
    "RANGE_BYTES",
    "STALE_TMP_SECONDS",
    "TMP_MARKER",
    "UPLOAD_PART",
    "Location",
    "PathLike",
    "abandoned_tmps",
    "announce_write",
    "atomic_write",
    "copy_range",
    "crc32",
    "crc32_range",
    "file_size",
    "fresh_tmp",
    "fspath",
    "fsync_dir",
    "get_filesystem",
    "host",
    "is_abandoned_tmp",
    "is_local",
    "is_object_store",
    "join",
    "list_files",
    "local_target",
    "make_private",
    "mapped_path",
    "open_for_read",
    "open_local",
    "owner_name",
    "pid_alive",
    "pinned",
    "private_problem",
    "process_of_mine",
    "process_start",
    "progress_hook",
    "publish",
    "ranged_reads",
    "remove",
    "report_progress",
    "resolve",
    "streams_multipart",
    "tmp_name",
    "wait_for_write",
]  # fmt: skip
