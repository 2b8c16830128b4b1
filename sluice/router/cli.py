"""`sluice router`'s command line (the server itself, with its FastAPI and uvicorn, is imported
only when the command runs, so other commands work where those are not installed)."""

from __future__ import annotations

import argparse

from sluice.kv_transfer.disagg.config import DEFAULT_BOOTSTRAP_PORT
from sluice.router.policies import POLICIES


def _prefill_arg(values: list[str]) -> tuple[str, int]:
    if len(values) not in (1, 2):
        raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {values}")
    port = DEFAULT_BOOTSTRAP_PORT
    if len(values) == 2:
        try:
            port = int(values[1])
        except ValueError:
            raise ValueError(f"--prefill {values[0]}: the bootstrap port must be an integer, "
                             f"got {values[1]!r}") from None
    return values[0], port


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("router", help="OpenAI-compatible router over plain replicas "
                                           "(--worker) or prefill/decode pairs (--prefill, "
                                           "--decode)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: a free port (logged)")
    parser.add_argument("--worker", action="append", default=[], metavar="URL",
                        help="a colocated `sluice serve` replica; repeat for more (plain mode: "
                             "not with --prefill/--decode)")
    parser.add_argument("--prefill", nargs="+", action="append", default=[],
                        metavar=("URL", "BOOTSTRAP_PORT"),
                        help="a prefill instance and its bootstrap port (default "
                             f"{DEFAULT_BOOTSTRAP_PORT}); repeat for more")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a decode instance; repeat for more")
    parser.add_argument("--policy", default="round_robin", choices=POLICIES)
    parser.add_argument("--prefill-policy", default=None, choices=POLICIES,
                        help="(default: --policy)")
    parser.add_argument("--decode-policy", default=None, choices=POLICIES,
                        help="(default: --policy)")
    parser.add_argument("--max-retries", type=int, default=3,
                        help="new workers (or pairs) tried after a failed attempt (default: 3)")
    parser.add_argument("--health-check-interval", type=float, default=2.0,
                        help="seconds between health checks of every instance (default: 2)")
    parser.add_argument("--health-failure-threshold", type=int, default=2,
                        help="failed health checks in a row that drop an instance (default: 2)")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="longest wait for an instance's answer, seconds (default: 600)")
    parser.add_argument("--log-level", default="info")
    parser.set_defaults(func=_cmd_router)


def _cmd_router(ns: argparse.Namespace) -> int:
    from sluice.router.server import RouterArgs, run_router

    args = RouterArgs(
        prefills=tuple(_prefill_arg(values) for values in ns.prefill),
        decodes=tuple(ns.decode), workers=tuple(ns.worker), host=ns.host, port=ns.port,
        policy=ns.policy,
        prefill_policy=ns.prefill_policy, decode_policy=ns.decode_policy,
        max_retries=ns.max_retries, health_check_interval_s=ns.health_check_interval,
        health_failure_threshold=ns.health_failure_threshold,
        request_timeout_s=ns.request_timeout, log_level=ns.log_level)
    return run_router(args)
