"""Ending a process without the interpreter's teardown.

A process that imported torch and transformers spends 1.5 s of CPU after its last line
tearing its modules down (torch alone 0.6 s), object by object; nothing of it is
needed once the process's work is done and its files are closed. Every engine and
training rank pays it when a job ends (and an engine when it is stopped at a handoff),
one after another along the job's shutdown; on a node whose cores the job's processes
share, it is CPU taken from the ones still working.

`exit_now(code)` does what the interpreter's exit does first and then stops: it waits
for the non-daemon threads (and runs the thread pools' exit hooks) as `threading`'s
shutdown does, runs the atexit handlers (weakref finalizers among them), shuts logging
down and flushes stdout and stderr, then `os._exit(code)`. Only for the end of a main
program whose writes are closed (ours are atomic or whole-line appends, each closed):
an open file's unflushed buffer would be lost. Where `threading._shutdown` is missing
(a Python that renamed it), it exits the normal way.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int | None = 0) -> NoReturn:
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None:
        sys.exit(code)
    shutdown()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to say
            pass
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))
