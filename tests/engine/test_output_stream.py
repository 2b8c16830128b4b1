"""RequestOutputStream: what a caller has not taken yet merges into one output (DELTA) or is
replaced by the newest (CUMULATIVE, FINAL_ONLY); a dead engine is reported after the rest."""

from __future__ import annotations

import asyncio

import pytest

from sluice.engine.output_stream import EngineDiedInFlight, RequestOutputStream
from sluice.engine.processors import RequestOutputKind
from sluice.outputs import CompletionOutput, Logprob, RequestOutput


def output(texts: list[str], token_ids: list[list[int]], finish: list[str | None],
           prompt_logprobs: list | None = None, num_cached_tokens: int = 0) -> RequestOutput:
    samples = [CompletionOutput(index=i, text=t, token_ids=ids,
                                cumulative_logprob=-float(len(ids)),
                                logprobs=[{tid: Logprob(-1.0)} for tid in ids],
                                finish_reason=f, stop_reason=None if f is None else "x")
               for i, (t, ids, f) in enumerate(zip(texts, token_ids, finish))]
    return RequestOutput("r", "p", [1, 2], prompt_logprobs, samples,
                         finished=all(f is not None for f in finish),
                         num_cached_tokens=num_cached_tokens)


def test_delta_outputs_waiting_merge_per_sample() -> None:
    async def main() -> RequestOutput:
        stream = RequestOutputStream(RequestOutputKind.DELTA)
        first = output(["a", "x"], [[1], [9]], [None, None])
        stream.put(first)
        stream.put(output(["b", ""], [[2], [8]], [None, "length"], num_cached_tokens=16))
        stream.put(output(["c", ""], [[3], []], ["stop", "length"], prompt_logprobs=[None]))
        merged = await stream.get()
        # The caller's own objects are not changed by later merges.
        assert first.outputs[0].text == "a" and first.outputs[0].token_ids == [1]
        return merged

    merged = asyncio.run(main())
    a, b = merged.outputs
    assert (a.text, a.token_ids, [list(p) for p in a.logprobs]) == ("abc", [1, 2, 3],
                                                                     [[1], [2], [3]])
    assert (a.finish_reason, a.stop_reason, a.cumulative_logprob) == ("stop", "x", -1.0)
    assert (b.text, b.token_ids, b.finish_reason) == ("x", [9, 8], "length")
    assert merged.finished and merged.num_cached_tokens == 0
    assert merged.prompt_logprobs == [None]


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY])
def test_whole_outputs_waiting_are_replaced_by_the_newest(kind: RequestOutputKind) -> None:
    async def main() -> RequestOutput:
        stream = RequestOutputStream(kind)
        stream.put(output(["a"], [[1]], [None]))
        stream.put(output(["ab"], [[1, 2]], ["stop"]))
        return await stream.get()

    newest = asyncio.run(main())
    assert newest.outputs[0].text == "ab" and newest.finished


def test_a_caller_that_keeps_up_gets_every_output_and_then_the_death() -> None:
    async def main() -> list[str]:
        stream = RequestOutputStream(RequestOutputKind.DELTA)
        got: list[str] = []

        async def consume() -> None:
            while True:
                try:
                    got.append((await stream.get()).outputs[0].text)
                except EngineDiedInFlight:
                    got.append("dead")
                    return

        task = asyncio.create_task(consume())
        for text in "abc":
            stream.put(output([text], [[1]], [None]))
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        stream.put(output(["d"], [[1]], [None]))
        stream.put_dead()  # the output before the death still arrives
        await asyncio.wait_for(task, 5)
        return got

    assert asyncio.run(main()) == ["a", "b", "c", "d", "dead"]
