"""Stage marks: where a request's time goes across the processes it passes (router, API
servers, engine cores, PD KV managers), for investigations such as the PD hand-off's.

With SLUICE_STAGE_TRACE=1 in a process's environment, `mark(event, detail)` writes
`STAGE <unix time> <pid> <event> <detail>` to its stderr (the instance logs), and
benchmarks/tools/pd_stage_trace.py merges the marks of every process of a run into one timeline
per request. Off (the default), a mark is one test of a module constant. The events:

  router_in, router_first        the router has a request; it read the first token's event
  api_in                         an API server's /v1/completions has the parsed request
  core_add, core_out N           the engine core took the request; sent outputs of N tokens
  sched N, result N              a step of N tokens scheduled; its result taken
  fe_out N                       the front end received outputs of N tokens
  d_alloc, d_export, d_ask       decode: blocks for a remote prefill; the cache's export; ask sent
  d_status, d_first              decode: a status from the prefill; the first token taken
  p_ask, p_ready                 prefill: a decode's ask arrived; a held request released
  finished, p_add_send           a PD request finished (prefill: True); its send reached the worker
  p_room_start, p_room_synced    prefill: the room's write began; the last step's KV is written
  p_status                       prefill: a status sent to the decode
"""

from __future__ import annotations

import os
import sys
import time

ON = os.environ.get("SLUICE_STAGE_TRACE", "") not in ("", "0")


def mark(event: str, detail: str = "") -> None:
    if ON:
        sys.stderr.write(f"STAGE {time.time():.6f} {os.getpid()} {event} {detail}\n")
        sys.stderr.flush()
