"""The engine's own thread, for a server: it compiles the warm-up shapes one at a time (counting them, so
a server can say how far it is), then steps the engine while it has work, sleeping otherwise. A step that
raises fails the requests the engine held (`Engine.abort`) and the thread serves the next ones. Nothing but
the engine runs on it: what it hands out goes through each request's output queue (rlkjax.engine.outputs).
"""

import logging
import threading
import time

from rlkjax.engine import compilation_cache
from rlkjax.engine.engine import Engine

log = logging.getLogger("serve.rollout")


class EngineThread:
    """`start()`, `kick()` after queueing work for the engine, `stop(grace)` at the end. warm_up_todo: the
    (program, rows) shapes to compile before serving; `ready` is set once they are, `failure` holds what
    stopped the warm-up."""

    def __init__(self, engine: Engine, warm_up_todo: list):
        self.engine, self.warm_up_todo = engine, warm_up_todo
        self.warmed_up = 0  # shapes of warm_up_todo compiled so far
        self.warm_up_started = time.monotonic()
        self.ready = threading.Event()  # the warm-up is done: the engine serves from then on
        self.failure: BaseException | None = None  # the warm-up failed: nothing will ever be served
        self.wake = threading.Condition()
        self.stopping = False  # the thread exits once the engine is idle
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def kick(self) -> None:
        """Wake the thread: the engine has work (a request, a cancel, new weights)."""
        with self.wake:
            self.wake.notify()

    def stop(self, grace: float) -> None:
        """Let the thread finish what the engine holds and exit, waiting at most `grace` seconds (a step stuck on
        the device must not keep the process alive: the thread is a daemon)."""
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join(grace)

    def stopped(self) -> bool:
        """The thread has exited (or never started)."""
        return not self.thread.is_alive()

    def _warm_up(self) -> bool:
        """Compile the warm-up shapes one at a time, logging each; False if stopped or failed first."""
        start, total = time.monotonic(), len(self.warm_up_todo)
        self.warm_up_started = start
        with compilation_cache.CompileTimes() as times:
            if total:
                try:  # several at once; what is not on disk compiles below, one shape at a time
                    loaded = self.engine.load_warm_up()
                    log.info("warm-up: %d of %d shapes' executables read from the cache", loaded, total)
                except Exception:  # the shape's own warm-up below reports it, or compiles past it
                    log.exception("warm-up: reading stored executables failed")
            for name, rows in self.warm_up_todo:
                if self.stopping:
                    return False
                try:
                    seconds = self.engine.warm_up_shape(name, rows)
                except Exception as e:  # e.g. the KV cache does not fit: nothing will ever be served
                    log.exception("warm-up failed at %s, %d rows", name, rows)
                    self.failure = e
                    return False
                self.warmed_up += 1
                log.info("warm-up %d/%d: %s, %d rows, %.1f s", self.warmed_up, total, name, rows, seconds)
        if total:
            log.info("warm-up: %d shapes compiled in %.1f s (%s)", total, time.monotonic() - start, times)
        log.info("ready")
        self.ready.set()
        return True

    def _run(self) -> None:
        if not self._warm_up():
            return
        engine = self.engine
        while True:
            with self.wake:
                while not (engine.busy or engine.weights_pending or self.stopping):
                    self.wake.wait()
                if self.stopping and not (engine.busy or engine.weights_pending):
                    return
            try:
                engine.step()
            except Exception as e:  # a bug or a device error: fail what it held, keep serving the next requests
                log.exception("engine step failed; failing the requests it held")
                engine.abort(f"the engine failed while serving this request: {type(e).__name__}: {e}")
