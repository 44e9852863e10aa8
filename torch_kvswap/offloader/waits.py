"""Blocking waits that Ctrl-C interrupts at once.

CPython runs a signal handler only in the main thread, and only once that
thread runs Python code. The kernel may deliver SIGINT to any thread that
does not block it: when a worker thread (a lane's, or one of torch's) takes
it, a main thread asleep in ``Event.wait()`` without a timeout sleeps on
until the event is set, so Ctrl-C during a long copy would wait for the
copy. These waits wake every ``SIGNAL_CHECK_SECONDS`` to let
the handler run; an event set in between still wakes them at once.
"""

from __future__ import annotations

import threading

#: How often a blocked wait wakes to let a pending signal handler run.
SIGNAL_CHECK_SECONDS = 0.05


def wait_for(event: threading.Event) -> None:
    """``event.wait()``, interruptible by Ctrl-C in the main thread."""
    while not event.wait(SIGNAL_CHECK_SECONDS):
        pass
