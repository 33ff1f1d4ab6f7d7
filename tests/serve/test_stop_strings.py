"""Stop strings on the decoded text: where they cut, and what streaming may send before they match."""

from __future__ import annotations

import random

import pytest

from kvbridge.engine.outputs import CompletionOutput
from kvbridge.serve.stop_strings import ChoiceText, find_stop, partial_stop_len


def _feed(choice: ChoiceText, texts: list[str], last_reason: str = "length") -> list[str]:
    """Feed cumulative texts (one token each) as the engine reports them; returns the streamed deltas."""
    deltas = []
    for i, text in enumerate(texts):
        finished = i == len(texts) - 1
        out = CompletionOutput(0, list(range(i + 1)), text, last_reason if finished else None)
        deltas.append(choice.update(out, finished).text)
        if choice.is_finished:
            break
    return deltas


def test_find_stop_gives_the_earliest_match_of_any_string():
    assert find_stop("ab END cd\n\n", ("\n\n", "END")) == 3
    assert find_stop("ab END", ("END",), start=4) is None
    assert find_stop("abc", ()) is None


def test_partial_stop_len_is_the_longest_tail_that_begins_a_stop_string():
    assert partial_stop_len("xxEN", ("END", "N!")) == 2
    assert partial_stop_len("xxE", ("END",)) == 1
    assert partial_stop_len("xxEND", ("END",)) == 0  # a whole match is find_stop's, not held back
    assert partial_stop_len("xx", ("END",)) == 0


def test_the_text_ends_before_the_stop_string_and_the_request_stops():
    choice = ChoiceText(("\n\n",))
    _feed(choice, ["Hel", "Hello wo", "Hello world\n", "Hello world\n\nmore", "never seen"])
    assert choice.text == "Hello world" and choice.finish_reason == "stop" and choice.is_stopped
    assert choice.token_ids == [0, 1, 2, 3]  # up to the token that completed the stop string


def test_streaming_holds_back_what_may_become_a_stop_string():
    choice = ChoiceText(("END",))
    assert _feed(choice, ["abE", "abEN", "abEND", "abEND tail"]) == ["ab", "", ""]
    assert choice.text == "ab" and choice.finish_reason == "stop"


def test_held_back_text_is_sent_once_it_cannot_be_a_stop_string():
    choice = ChoiceText(("END",))
    assert _feed(choice, ["abE", "abEN", "abENx"]) == ["ab", "", "ENx"]
    assert choice.text == "abENx" and choice.finish_reason == "length" and not choice.is_stopped


def test_the_stop_string_that_completes_first_wins():
    choice = ChoiceText(("cdef", "de"))
    _feed(choice, ["abc", "abcd", "abcde", "abcdef"])
    assert choice.text == "abc"  # "de" completed first; "cdef" would have cut at 2 but never completed


def test_of_stop_strings_completing_in_one_step_the_earliest_wins():
    choice = ChoiceText(("de", "cdef"))
    _feed(choice, ["abc", "abcdef"])
    assert choice.text == "ab"


def test_a_half_utf8_character_is_held_until_it_completes():
    choice = ChoiceText()
    assert _feed(choice, ["a\ufffd", "a\u00e9", "a\u00e9\ufffd"]) == ["a", "\u00e9", "\ufffd"]  # the last one finished


def test_no_stop_strings_stream_every_settled_character():
    choice = ChoiceText()
    assert _feed(choice, ["a", "ab", "abc"]) == ["a", "b", "c"] and choice.finish_reason == "length"


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_streamed_text_equals_the_text_cut_at_the_first_stop_to_complete(seed):
    print(f"seed {seed}")
    rng = random.Random(seed)
    alphabet = "ab\n"
    for _ in range(300):
        tokens = ["".join(rng.choices(alphabet, k=rng.randint(1, 3))) for _ in range(rng.randint(1, 12))]
        stop = tuple({"".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))})
        texts = ["".join(tokens[: i + 1]) for i in range(len(tokens))]
        # The reference: the first step whose text holds a stop string is cut where the earliest starts.
        cuts = ((text, find_stop(text, stop)) for text in texts)
        expected = next((text[:cut] for text, cut in cuts if cut is not None), None)
        choice = ChoiceText(stop)
        streamed = "".join(_feed(choice, texts))
        assert streamed == choice.text == (texts[-1] if expected is None else expected), (tokens, stop)
        assert choice.is_stopped == (expected is not None)


@pytest.mark.parametrize("seed", [0, 1])
def test_partial_stop_len_equals_the_longest_tail_found_by_brute_force(seed):
    print(f"seed {seed}")
    rng = random.Random(seed)
    for _ in range(2000):
        text = "".join(rng.choices("abc", k=rng.randint(0, 8)))
        stop = ["".join(rng.choices("abc", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        tails = [k for k in range(1, len(text) + 1) if any(len(s) > k and s.startswith(text[-k:]) for s in stop)]
        assert partial_stop_len(text, stop) == max(tails, default=0), (text, stop)
