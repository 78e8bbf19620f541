"""Wait for a corelib server to answer ``/health``: exit 0 once it does, 1 when its process ends first or the
deadline passes (the benchmark scripts start a server in the background, then call this).

    python3 benchmarks/wait_for_server.py PORT [PID] [--timeout 300]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import httpx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int)
    parser.add_argument("pid", type=int, nargs="?", help="the server's process: stop waiting when it exits")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if args.pid is not None:
            try:
                os.kill(args.pid, 0)
            except ProcessLookupError:
                return 1
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=2).status_code == 200:
                return 0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return 1


if __name__ == "__main__":
    sys.exit(main())
