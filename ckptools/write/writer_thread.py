"""One background write at a time: a thread that does file I/O (never a collective) and keeps
its error for the caller's thread.

`ckptools.write.async_save.AsyncSave` runs each async save's write in one; the Lightning plugin
(`AsyncCkptoolsCheckpointIO`) keeps one for its own saves. What the thread does on success and
on failure (the "saved" record, the error logged the moment it happens, housekeeping after the
commit) is the same for both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .. import log
from ..storage import (
    BACKGROUND_NICENESS,
    Stall,
    WriteAbandoned,
    announce_write,
    watch,
    watched,
    write_progress,
    yield_to_the_step,
)

__all__ = ["BACKGROUND_NICENESS", "BackgroundWriter", "yield_to_the_step"]


class BackgroundWriter:
    """Runs a write in a background thread and keeps what it raised.

    Args:
        name: the thread's name.
        raised_at: where the caller will see a failure, said in the log line written when it happens.

    Examples:
        >>> writer = BackgroundWriter("doc-writer")
        >>> writer.start("/tmp/nothing.pt", lambda: None)
        >>> writer.join(); writer.error is None
        True
    """

    def __init__(self, name: str, *, raised_at: str = "") -> None:
        self.name, self.raised_at = name, raised_at
        self.path = ""  # what the write in flight writes
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stall: Stall | None = None  # how long the write in flight has not moved, as looks saw it

    def start(
        self,
        path: str,
        write: Callable[[], int | None],
        *,
        after: Callable[[], None] | None = None,
        started: float | None = None,
        announce: bool = False,
        inline: bool = False,
    ) -> None:
        """Run ``write`` (then ``after``, housekeeping that must follow the commit) in a new thread.

        ``write`` returns the bytes of the file it committed, or None where another writer
        commits it (a rank's share with ``writers="all"``: nothing is logged as saved). With
        ``announce``, whoever resolves ``path`` in this process meanwhile waits for the write
        (`ckptools.storage.announce_write`); with ``inline`` the write runs here, in the caller's thread.
        """
        started = time.monotonic() if started is None else started
        self.path = path
        announced = announce_write(path) if announce else None

        def run() -> None:
            if not inline:  # a thread of its own: behind the loop's step (never the caller's thread)
                yield_to_the_step()
            if announced is not None:
                announced.doing()
            try:
                with watched():
                    written = write()
            except WriteAbandoned as err:  # its waiter gave up on it and holds the StorageStalledError
                log.logger.error("background save of %s given up: %s", path, err)
                return
            except BaseException as err:  # noqa: BLE001 - kept for the caller's thread, which raises it
                self.error = err
                # Said now as well, in case the process ends before anything looks at it.
                log.logger.error(
                    "background save of %s failed: %s: %s%s", path, type(err).__name__, err, self.raised_at
                )
                return
            finally:
                if announced is not None:
                    announced.done()
            if written is None:
                return
            log.report("saved", path, started, written)
            if after is not None:
                after()

        if inline:
            run()
            return
        # Not a daemon: a script that returns with a save in flight still gets its file, as the
        # interpreter joins non-daemon threads before it exits.
        self._thread = threading.Thread(target=run, name=self.name, daemon=False)
        self._thread.start()
        self._stall = Stall(self._thread)

    def progress(self) -> tuple[float, float, int, bool] | None:
        """How far the write in flight came (`ckptools.storage.write_progress`), or None when none runs."""
        thread = self._thread
        if thread is None or not thread.is_alive() or thread.ident is None:
            return None
        return write_progress(thread.ident) or (0.0, 0.0, 0, False)

    def idle(self) -> float:
        """Seconds the write in flight has not moved (`ckptools.storage.Stall`: what `join` judges it by);
        0 when none runs."""
        thread, stall = self._thread, self._stall
        if thread is None or stall is None or not thread.is_alive():
            return 0.0
        looked = stall.look()
        return 0.0 if looked is None else looked[0]

    def join_for(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the write in flight (if any) to end (local; `join` still collects it)."""
        thread = self._thread
        if thread is not None and seconds > 0:
            thread.join(seconds)

    def done(self) -> bool:
        """Whether no write is running (local, never blocks)."""
        return self._thread is None or not self._thread.is_alive()

    def join(self) -> None:
        """Block until the write in flight (if any) ended, or its storage made no progress for the stall bound
        (`watch`): then it is given up, and `error` is the `StorageStalledError` to raise."""
        if self._thread is not None:
            stalled = watch(self._thread, self.path, stall=self._stall)
            if stalled is not None:
                self.error = stalled
            # Let go of the finished thread: an owner pickled afterwards (``torch.save(trainer)``
            # with the Lightning plugin in it) must not carry a thread's lock.
            self._thread = self._stall = None

    def take_error(self) -> BaseException | None:
        """The error of the last write (once: it is cleared)."""
        error, self.error = self.error, None
        return error
