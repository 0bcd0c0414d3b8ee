"""The one door to files: local paths and fsspec URLs (``s3://``, ``memory://``, ...).

Paths stay ``str`` throughout, because a URL run through ``pathlib.Path`` loses its ``//``.

===========  ==============================================================================
module       its one job
===========  ==============================================================================
paths.py     a path or URL resolved once (`Location`), joins, listings, temporary names and the
             ones a writer that is gone left behind; what is in flight in this process (a path's
             background write, which resolving it waits for; the async save, finished first)
writes.py    atomic writes: local (temporary file, fsync, rename, directory fsync), S3
             (a streamed multipart upload, completed last), other stores (one PUT or a move);
             waiting for a watched write, and giving up on a stuck one
reads.py     a local file opened once and checked on its descriptor, a remote one fetched once;
             byte ranges copied or CRC-32-checked, progress
checksum.py  CRC-32, through ISA-L where installed (seven times zlib's speed)
private.py   folders only this user can change (node memory in a folder every local user shares)
processes.py whether a process runs, when it started, whether it is this user's; a background
             thread's priority (behind the training step), how far each watched write came
===========  ==============================================================================

Everything else imports from this package, never from its modules.
"""

from __future__ import annotations

from .checksum import FAST_CRC32, crc32
from .paths import (
    STALE_TMP_SECONDS,
    TMP_MARKER,
    Location,
    PathLike,
    abandoned_tmps,
    file_size,
    finish_pending,
    forget_pending,
    fresh_tmp,
    fspath,
    fsync_dir,
    get_filesystem,
    host,
    is_abandoned_tmp,
    is_local,
    is_object_store,
    join,
    list_files,
    pending,
    remove,
    resolve,
    set_pending,
    tmp_name,
)
from .paths import announce as announce_write
from .paths import wait_for as wait_for_write
from .private import make_private, owner_name, private_problem
from .processes import (
    BACKGROUND_NICENESS,
    WriteAbandoned,
    abandon,
    moved,
    pid_alive,
    process_of_mine,
    process_start,
    watched,
    watched_fsync,
    write_progress,
    yield_to_the_step,
)
from .reads import (
    NODE_MARK,
    RANGE_BYTES,
    RANGES_AT_ONCE,
    copy_range,
    crc32_mapped,
    crc32_range,
    mapped_path,
    open_for_read,
    open_local,
    pinned,
    progress_hook,
    ranged_reads,
    report_progress,
)
from .writes import (
    CALLER,
    STALL_ENV,
    UPLOAD_PART,
    InThread,
    Stall,
    atomic_write,
    local_target,
    publish,
    run_watched,
    stall_timeout,
    streams_multipart,
    watch,
)

__all__ = [
    "BACKGROUND_NICENESS",
    "CALLER",
    "FAST_CRC32",
    "NODE_MARK",
    "RANGES_AT_ONCE",
    "RANGE_BYTES",
    "STALE_TMP_SECONDS",
    "STALL_ENV",
    "TMP_MARKER",
    "UPLOAD_PART",
    "InThread",
    "Location",
    "PathLike",
    "Stall",
    "WriteAbandoned",
    "abandon",
    "abandoned_tmps",
    "announce_write",
    "atomic_write",
    "copy_range",
    "crc32",
    "crc32_mapped",
    "crc32_range",
    "file_size",
    "finish_pending",
    "forget_pending",
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
    "moved",
    "open_for_read",
    "open_local",
    "owner_name",
    "pending",
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
    "run_watched",
    "set_pending",
    "stall_timeout",
    "streams_multipart",
    "tmp_name",
    "wait_for_write",
    "watch",
    "watched",
    "watched_fsync",
    "write_progress",
    "yield_to_the_step",
]  # fmt: skip
