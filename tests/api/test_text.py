"""Text-side pieces without a model: stop strings over token deltas, the reasoning split, sampling parameters.

The sampler itself (penalties, seeds, filters) is tested in tests/engine/test_sampler.py."""
from __future__ import annotations

import pytest

from ktrans.engine.output import TextStream, held_suffix
from ktrans.api.reasoning import ReasoningParser, split_reasoning
from ktrans.engine.sampler import SamplingParams


class PieceTokenizer:
    """Token i is pieces[i]; enough of the Tokenizer interface for TextStream."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def detokenizer(self, skip_special_tokens: bool = True):
        pieces = self.pieces

        class Detok:
            def add(self, i: int) -> str:
                return pieces[i]

            def flush(self) -> str:
                return ""

        return Detok()


def run_stream(pieces: list[str], stops: tuple[str, ...]):
    ts = TextStream(PieceTokenizer(pieces), stops)
    deltas = []
    for i in range(len(pieces)):
        deltas.append(ts.add(i))
        if ts.stopped_by:
            break
    else:
        deltas.append(ts.finish())
    return deltas, ts.stopped_by


def test_stop_string_across_three_tokens_is_left_out():
    deltas, stop = run_stream(["Hel", "lo, wo", "rl", "d! more"], ("o, world",))
    assert "".join(deltas) == "Hell" and stop == "o, world"
    assert deltas[0] == "Hel"  # nothing held before a possible start


def test_held_text_is_released_when_it_stops_matching():
    deltas, stop = run_stream(["ab", "c", "x", "yz"], ("cd",))
    assert stop is None and deltas == ["ab", "", "cx", "yz", ""]


def test_earliest_stop_wins_and_text_before_it_is_kept():
    deltas, stop = run_stream(["one two three"], ("three", "two"))
    assert "".join(deltas) == "one " and stop == "two"


def test_held_suffix():
    assert held_suffix("abc", ("cde",)) == 1
    assert held_suffix("abcd", ("bcdx", "d")) == 3
    assert held_suffix("abc", ()) == 0


@pytest.mark.parametrize("cut", range(1, 30))
def test_reasoning_split_any_delta_boundaries(cut):
    text = "<think>\nstep one</think>\n\nThe answer."
    p = ReasoningParser()
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    r = c = ""
    for piece in pieces:
        dr, dc = p.feed(piece)
        r, c = r + dr, c + dc
    dr, dc = p.finish()
    assert (r + dr, c + dc) == ("\nstep one", "The answer.")


def test_reasoning_without_tags_is_content():
    assert split_reasoning("Just an answer.") == (None, "Just an answer.")
    assert split_reasoning("a < b") == (None, "a < b")
    # a thinking template opened <think> in the prompt: the output starts inside the reasoning
    assert split_reasoning("hmm</think>\n\nok", starts_in_reasoning=True) == ("hmm", "ok")
    assert split_reasoning("<think>unfinished") == ("unfinished", "")


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(repetition_penalty=0),
                                 dict(presence_penalty=3), dict(max_tokens=-1), dict(stop=("",))])
def test_bad_sampling_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
