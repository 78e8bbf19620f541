"""Entry point: ``python -m corelib`` (and the ``corelib`` command)."""

import contextlib
import logging
import os
import signal
import sys

from corelib.cli.main import main

INTERRUPTED = (130, 128 + signal.SIGTERM)


def entry() -> int:
    """Run the CLI; after Ctrl-C or SIGTERM, leave at once.

    By then every engine, worker process and segment has been closed on the way out; what is
    left is the interpreter's teardown, which can wait seconds for a forward still running on an
    emulated stream's thread. The logs and the standard streams are flushed first.
    """
    code = main()
    if code in INTERRUPTED:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing to keep
                stream.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(entry())
