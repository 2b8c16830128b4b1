"""A Mooncake Store client process that only owns a segment of the pool's memory, until SIGTERM
(or SIGKILL, to play a crashed instance). Started by `servers.start_mooncake_segment_owner`.

    python -m sluice.testing.mooncake_segment --master 127.0.0.1:50051 --segment-size 67108864 \
        --ready-file /tmp/ready
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", required=True, help="the master's HOST:PORT")
    parser.add_argument("--segment-size", type=int, required=True, help="bytes to mount")
    parser.add_argument("--local-hostname", default="127.0.0.1")
    parser.add_argument("--ready-file", type=Path, help="created once the segment is mounted")
    args = parser.parse_args(argv)
    if args.segment_size <= 0:
        parser.error(f"--segment-size must be positive, got {args.segment_size}")

    from mooncake.store import MooncakeDistributedStore

    # Block the signals before the client starts its threads, so that they reach sigwait.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    store = MooncakeDistributedStore()
    rc = store.setup(args.local_hostname, "P2PHANDSHAKE", args.segment_size, 16 << 20, "tcp",
                     "", args.master)
    if rc != 0:
        print(f"mooncake segment owner: setup with master {args.master} failed (rc {rc})",
              file=sys.stderr)
        return 1
    if args.ready_file is not None:
        args.ready_file.touch()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
