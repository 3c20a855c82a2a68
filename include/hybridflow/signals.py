"""Stopping long-running commands: SIGTERM and SIGINT end them cleanly whatever they inherited.

A process started from a background shell (``cmd &``, ``nohup``) inherits SIGINT ignored, and
Python only turns SIGINT into KeyboardInterrupt when it was not; SIGTERM would kill it without its
``finally`` blocks. Servers therefore install both handlers themselves, as the gang workers do.
"""

from __future__ import annotations

import signal


def stop_on_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt in the main thread (where ``serve_forever`` or a
    sleep loop runs), so the command's own clean-up runs and it exits 0."""

    def _stop(signum, frame) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
