"""The router's pieces without engines: the policies' choices, what it refuses, how it reads a
decode's stream, the command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluice.entrypoints.cli import build_parser, build_router_parser
from sluice.router.cli import _prefill_arg
from sluice.router.policies import CacheAware, LeastLoaded, RoundRobin
from sluice.router.proxy import refusal
from sluice.router.relay import carries_token, failed_before_first_token, prompt_key
from sluice.router.server import RouterArgs
from sluice.router.workers import Worker

pytestmark = pytest.mark.serial


def workers(*loads: int) -> list[Worker]:
    return [Worker(f"http://127.0.0.1:{9000 + i}", "prefill", 8998, healthy=True,
                   in_flight=load)
            for i, load in enumerate(loads)]


def test_round_robin_and_least_loaded() -> None:
    pool = workers(0, 0, 0)
    policy = RoundRobin()
    assert [policy.pick(pool, "").url[-4:] for _ in range(4)] == ["9000", "9001", "9002", "9000"]
    pool = workers(3, 1, 1)
    least = LeastLoaded()
    assert {least.pick(pool, "").url[-4:] for _ in range(4)} == {"9001", "9002"}


def test_cache_aware_sends_a_shared_prefix_where_it_went_unless_that_one_is_swamped() -> None:
    pool = workers(0, 0, 0)
    policy = CacheAware(chunk_chars=8, match_threshold=0.5, balance_slack=2)
    long_prefix = "system: you are a helpful assistant. " * 4
    first = policy.pick(pool, long_prefix + "question one")
    first.in_flight += 1
    # Same prefix, most of the prompt: the same instance, though it is the busiest.
    assert policy.pick(pool, long_prefix + "question two") is first
    # An unrelated prompt goes to the least loaded.
    assert policy.pick(pool, "entirely different text here") is not first
    first.in_flight += 5  # too busy now: affinity yields to balance
    assert policy.pick(pool, long_prefix + "question three") is not first


def test_refusals_name_what_the_pd_router_cannot_do() -> None:
    assert refusal("/v1/completions", {"prompt": "x", "n": 2}).startswith("n and best_of")
    assert "prompt_logprobs" in refusal("/v1/completions", {"prompt": "x",
                                                            "prompt_logprobs": 1})
    assert "echo with logprobs" in refusal("/v1/completions", {"prompt": "x", "echo": True,
                                                               "logprobs": 1})
    assert "one prompt" in refusal("/v1/completions", {"prompt": ["a", "b"]})
    assert "router's to set" in refusal("/v1/chat/completions", {"kv_transfer_params": {}})
    assert refusal("/v1/completions", {"prompt": [1, 2, 3], "echo": True}) is None
    assert refusal("/v1/chat/completions", {"messages": [], "n": 1}) is None
    assert prompt_key("/v1/completions", {"prompt": [1, 2]}) == "1 2"
    assert prompt_key("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"}]}) == "user:hi"


def test_the_stream_commits_at_the_first_token_and_an_early_error_is_the_retry_signal() -> None:
    assert not carries_token({"index": 0, "delta": {"role": "assistant", "content": ""}})
    assert not carries_token({"index": 0, "text": "", "finish_reason": None})
    assert carries_token({"index": 0, "text": "Hi", "finish_reason": None})
    assert carries_token({"index": 0, "delta": {"content": "Hi"}})
    assert carries_token({"index": 0, "text": "", "finish_reason": "length"})
    assert failed_before_first_token({"finish_reason": "error"}, 0)
    assert not failed_before_first_token({"finish_reason": "error"}, 3)
    assert not failed_before_first_token({"finish_reason": "stop"}, 0)


@pytest.mark.parametrize("parser", [build_parser, build_router_parser])
def test_command_line_takes_sgl_routers_flag_shapes(parser) -> None:
    ns = parser().parse_args([
        "router", "--port", "0", "--prefill", "http://127.0.0.1:8100", "9001",
        "--prefill", "http://127.0.0.1:8101", "--decode", "http://127.0.0.1:8200",
        "--policy", "cache_aware"])
    assert [_prefill_arg(v) for v in ns.prefill] == [("http://127.0.0.1:8100", 9001),
                                                    ("http://127.0.0.1:8101", 8998)]
    assert ns.func.__module__ == "sluice.router.cli"
    with pytest.raises(ValueError, match="bootstrap port must be an integer"):
        _prefill_arg(["http://h:1", "x"])
    with pytest.raises(ValueError, match="at least one --prefill and one --decode"):
        RouterArgs(prefills=(), decodes=("http://127.0.0.1:1",))
    with pytest.raises(ValueError, match="http"):
        RouterArgs(prefills=(("127.0.0.1:1", 8998),), decodes=("http://127.0.0.1:1",))


def test_the_router_command_imports_no_pytorch() -> None:
    # The router runs no model: `sluice router`'s parser and its server leave PyTorch (and
    # transformers) unimported, so it starts in about a second.
    code = ("import sys\n"
            "from sluice.entrypoints.cli import main\n"
            "import sluice.router.server\n"
            "try:\n"
            "    main(['router', '--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "heavy = sorted({'torch', 'transformers', 'triton'} & set(sys.modules))\n"
            "print('heavy:', heavy)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage: sluice router" in run.stdout
    assert run.stdout.strip().endswith("heavy: []"), run.stdout[-500:]


@pytest.mark.parametrize("argv, message", [
    (["--worker", "http://127.0.0.1:8100", "--prefill", "http://127.0.0.1:8200"],
     "--worker (plain replicas) cannot be combined with the PD flags --prefill"),
    (["--worker", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"],
     "cannot be combined with the PD flags --decode"),
    (["--worker", "http://127.0.0.1:8100", "--decode-policy", "least_loaded"],
     "cannot be combined with the PD flags --decode-policy"),
    (["--worker", "127.0.0.1:8100"], "must be http(s)://host:port, got '127.0.0.1:8100'"),
    (["--worker", "http://127.0.0.1:port"], "must be http(s)://host:port"),
    (["--worker", "http://127.0.0.1:8100/v1"], "must be http(s)://host:port"),
    (["--worker", "http://127.0.0.1:8100", "--worker", "http://127.0.0.1:8100/"],
     "a --worker URL is given twice"),
    ([], "the router needs --worker URL (plain replicas), or at least one --prefill and one "
         "--decode (PD)"),
])
def test_router_command_line_errors_name_the_problem(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.entrypoints.cli import main

    assert main(["router", "--port", "0", *argv]) == 2
    assert message in capsys.readouterr().err


def test_only_workers_is_plain_mode_and_pd_flags_are_pd_mode() -> None:
    ns = build_router_parser().parse_args(["router", "--worker", "http://127.0.0.1:8100",
                                           "--worker", "http://127.0.0.1:8101"])
    assert ns.worker == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
    plain = RouterArgs(workers=tuple(ns.worker))
    assert plain.plain
    pd = RouterArgs(prefills=(("http://127.0.0.1:8100", 8998),), decodes=("http://127.0.0.1:1",))
    assert not pd.plain
