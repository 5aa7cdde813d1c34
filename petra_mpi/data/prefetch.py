"""Prefetch: a daemon thread that runs load(i) for i in a range, ahead of the consumer, into a
queue of `depth` entries (so memory stays bounded). An exception in the thread is carried to the
consumer and raised there; stop() ends the thread however the consumer stops."""
import atexit
import queue
import threading
import weakref

_live = weakref.WeakSet()  # prefetchers whose thread has started


@atexit.register
def _stop_all_at_exit():
    # Daemon threads are frozen wherever they stand when the interpreter finalises; one frozen
    # inside h5py holds its global lock, and closing the HDF5 files at teardown then deadlocks
    # (a hang at exit, about 1 run in 10). So stop them first: atexit runs before that freeze.
    for prefetch in list(_live):
        prefetch.stop()


class _Failure:
    """An exception raised in the prefetch thread, carried to the consumer."""

    def __init__(self, exc):
        self.exc = exc


class Prefetch:
    def __init__(self, load, start, stop_at, depth, name="petra-data-prefetch"):
        self.stopped = threading.Event()
        self._queue = queue.Queue(depth)
        self._thread = threading.Thread(target=self._produce, args=(load, start, stop_at),
                                        name=name, daemon=True)
        _live.add(self)
        self._thread.start()

    def _produce(self, load, start, stop_at):
        try:
            for i in range(start, stop_at):
                if self.stopped.is_set() or not self._put(load(i)):
                    return
        except BaseException as e:  # noqa: B902  (carried to the consumer, re-raised there)
            self._put(_Failure(e))

    def _put(self, item):
        # A timed put: a consumer that went away (stopped set) never leaves this thread blocked.
        while not self.stopped.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def get(self):
        """The next item; None once stopped."""
        while not self.stopped.is_set():
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("data prefetch thread ended unexpectedly") from None
                continue
            if isinstance(item, _Failure):
                raise item.exc
            return item
        return None

    def stop(self):
        self.stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


class NoPrefetch:
    """Prefetch's interface with depth 0: load(i) runs in the consumer's thread at get()."""

    def __init__(self, load, start):
        self.stopped = threading.Event()
        self._load, self._next = load, start

    def get(self):
        if self.stopped.is_set():
            return None
        self._next += 1
        return self._load(self._next - 1)

    def stop(self):
        self.stopped.set()
