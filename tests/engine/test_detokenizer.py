"""IncrementalDetokenizer: exact incremental decoding, stop strings, held-back text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from sluice.engine.detokenizer import IncrementalDetokenizer, decode_token, ids_decoder
from sluice.sampling_params import SamplingParams

EOS = "<|endoftext|>"
_CORPUS = [
    "hello world, hello there. The quick brown fox jumps over the lazy dog.",
    "héllo wörld, héllo again wörld",
    "日本語のテキスト 你好世界",
    "emoji time 😀 🎉 done",
    "STOP stop Stop the count",
] * 3
# Multi-byte text whose characters the small vocabulary splits over several byte tokens.
_MULTIBYTE_TEXTS = ["héllo wörld 😀!", "日本語 你好 ok", "a🎉b 世界 wörld", "x😀😀y"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS)


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1,
        stop_terminated: bool = False) -> tuple[list[str], str | None]:
    """Feeds ids in chunks; returns the deltas emitted (the last with finished=True)."""
    deltas: list[str] = []
    stop = None
    for start in range(0, len(ids), chunk):
        new_ids = ids[start:start + chunk]
        last = start + chunk >= len(ids)
        stop = detok.update(new_ids, stop_terminated=stop_terminated and last)
        finished = last or stop is not None
        deltas.append(detok.get_next_output_text(finished=finished, delta=True))
        if stop is not None:
            break
    return deltas, stop


def test_test_data_splits_characters_over_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    for text in _MULTIBYTE_TEXTS:
        pieces = [tokenizer.decode([i]) for i in encode(tokenizer, text)]
        assert any("\ufffd" in piece for piece in pieces), (text, pieces)


@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("text", _MULTIBYTE_TEXTS + ["hello world, the quick fox"])
def test_incremental_decode_equals_full_decode(tokenizer: PreTrainedTokenizerFast, text: str,
                                               chunk: int) -> None:
    prompt = encode(tokenizer, "The quick brown 日本")
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas, stop = run(detok, ids, chunk)
    assert stop is None
    assert detok.output_text == tokenizer.decode(ids) == text
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)
    assert detok.token_ids == ids


def test_text_waits_for_the_last_byte_of_a_character(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(tokenizer, "😀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for token_id in ids[:-1]:
        detok.update([token_id], stop_terminated=False)
        assert detok.output_text == ""
    detok.update(ids[-1:], stop_terminated=False)
    assert detok.output_text == "😀"


def test_stop_string_across_token_boundary(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(tokenizer, "hello world, the quick fox")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert not any("lo wo" in piece for piece in pieces)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["xyz", "lo wo"]))
    completing = next(i for i in range(len(ids)) if "lo wo" in tokenizer.decode(ids[:i + 1]))
    # Found exactly at the token that completes it.
    for i, token_id in enumerate(ids[:completing + 1]):
        stop = detok.update([token_id], stop_terminated=False)
        assert stop == ("lo wo" if i == completing else None)
    assert detok.output_text == "hel"
    assert detok.get_next_output_text(finished=True, delta=False) == "hel"


def test_include_stop_str_in_output(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(tokenizer, "hello world, the quick fox")
    params = SamplingParams(stop=["lo wo"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas, stop = run(detok, ids)
    assert stop == "lo wo"
    assert detok.output_text == "hello wo"
    assert "".join(deltas) == "hello wo"


def test_earliest_of_several_stop_strings_wins(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(tokenizer, "the quick brown fox")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["own", "quick brown"]))
    stop = detok.update(ids, stop_terminated=False)
    assert stop == "quick brown"
    assert detok.output_text == "the "


def test_held_back_text_never_shows_a_stop_prefix(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "the ST quick STO fox STOP after"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"]))
    emitted = ""
    stop = None
    for token_id in ids:
        stop = detok.update([token_id], stop_terminated=False)
        if stop is not None:
            break
        delta = detok.get_next_output_text(finished=False, delta=True)
        emitted += delta
        # Everything shown is final text, and exactly len("STOP") - 1 chars are held back.
        assert "the ST quick STO fox ".startswith(emitted)
        assert len(emitted) == max(len(detok.output_text) - 3, 0)
        assert detok.get_next_output_text(finished=False, delta=False) == emitted
    assert stop == "STOP"
    emitted += detok.get_next_output_text(finished=True, delta=True)
    assert emitted == detok.output_text == "the ST quick STO fox "
    assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_full_text_is_emitted_at_finish_without_a_match(
        tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(tokenizer, "ends with ST")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"]))
    deltas, stop = run(detok, ids)
    assert stop is None
    assert deltas[-1].endswith("ST")
    assert "".join(deltas) == "ends with ST"


def test_stop_terminated_drops_eos_text(tokenizer: PreTrainedTokenizerFast) -> None:
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids = encode(tokenizer, "hello wörld") + [eos_id]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
        deltas, stop = run(detok, ids, chunk=2, stop_terminated=True)
        assert stop is None
        assert detok.output_text == "".join(deltas) == "hello wörld"
        assert detok.token_ids == ids


def test_min_tokens_delays_stop_strings(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "hello there, hello world"
    ids = encode(tokenizer, text)
    first_match = next(i + 1 for i in range(len(ids)) if "llo" in tokenizer.decode(ids[:i + 1]))
    assert first_match < len(ids)

    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["llo"]))
    run(detok, ids)
    assert detok.output_text == "he"

    params = SamplingParams(stop=["llo"], min_tokens=first_match)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas, stop = run(detok, ids)
    assert stop == "llo"
    assert detok.output_text == "".join(deltas) == "hello there, he"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer: PreTrainedTokenizerFast, skip: bool) -> None:
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids = encode(tokenizer, "hé") + [eos_id, eos_id] + encode(tokenizer, "llo 😀")
    detok = IncrementalDetokenizer(tokenizer, [eos_id], SamplingParams(skip_special_tokens=skip))
    deltas, _ = run(detok, ids)
    expected = "héllo 😀" if skip else f"hé{EOS}{EOS}llo 😀"
    assert tokenizer.decode(ids, skip_special_tokens=skip) == expected
    assert detok.output_text == "".join(deltas) == expected


def test_decode_token(tokenizer: PreTrainedTokenizerFast) -> None:
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    hello = encode(tokenizer, "hello")
    assert len(hello) == 1
    assert decode_token(tokenizer, hello[0]) == "hello"
    assert decode_token(tokenizer, eos_id) == EOS
    assert decode_token(tokenizer, encode(tokenizer, "😀")[0]) == "\ufffd"


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab é😀", min_size=0, max_size=24),
    stop=st.text(alphabet="ab é", min_size=1, max_size=3),
    include=st.booleans(),
    chunk=st.integers(1, 3),
)
def test_stop_string_property(tokenizer: PreTrainedTokenizerFast, text: str, stop: str,
                              include: bool, chunk: int) -> None:
    ids = encode(tokenizer, text)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    emitted = ""
    found = None
    for start in range(0, len(ids), chunk):
        found = detok.update(ids[start:start + chunk], stop_terminated=False)
        if found is not None:
            break
        emitted += detok.get_next_output_text(finished=False, delta=True)
    emitted += detok.get_next_output_text(finished=True, delta=True)

    index = text.find(stop)
    if index == -1:
        expected = text
        assert found is None
    else:
        expected = text[:index + len(stop)] if include else text[:index]
        assert found == stop
    assert detok.output_text == emitted == expected


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=299), max_size=12),
       skip=st.booleans())
def test_ids_decoder_decodes_as_the_tokenizer(tokenizer: PreTrainedTokenizerFast,
                                              ids: list[int], skip: bool) -> None:
    """The detokenizer's direct call into the Rust tokenizer gives transformers' decode."""
    expected = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert ids_decoder(tokenizer, skip)(ids) == expected


def test_ids_decoder_keeps_a_tokenizer_whose_decode_is_its_own(
        tokenizer: PreTrainedTokenizerFast) -> None:
    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids: object, **kwargs: object) -> str:
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting(tokenizer_object=tokenizer.backend_tokenizer, eos_token=EOS)
    ids = encode(tokenizer, "hello world")
    assert ids_decoder(shouting, False)(ids) == "HELLO WORLD"
    assert ids_decoder(tokenizer, False)(ids) == "hello world"
