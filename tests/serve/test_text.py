"""An answer's text as its tokens come: stop strings cut, text that may begin one held back."""
from __future__ import annotations

from flexgen_sparpr.serve.text import StopScan


def feed(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    s, out = StopScan(stops), ""
    for i, p in enumerate(pieces):
        out += s.feed(p, final=i == len(pieces) - 1)
        if s.hit:  # the answer ends there
            break
    return out, s.hit


def test_a_stop_string_across_pieces_ends_the_text_before_it():
    assert feed(["Hello wo", "rld, and ", "more"], ["world"]) == ("Hello ", True)
    assert feed(["a", "b", "c", "STO", "P", "d"], ["STOP", "x"]) == ("abc", True)


def test_a_false_start_is_handed_on_and_without_stops_nothing_is_held():
    s = StopScan(["STOP"])
    assert s.feed("go ST") == "go " and s.feed("ART") == "START"  # "ST" held, then handed on
    assert feed(["one ", "two"], []) == ("one two", False)
    assert feed(["ends in ST"], ["STOP"]) == ("ends in ST", False)  # the last piece: nothing held
