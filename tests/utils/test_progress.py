"""Progress bars: on only for a terminal's stderr and not --quiet; when on, they go to stderr alone
(prefill per layer, decode per token, the prompts of a multi-batch call), so stdout and the JSON
written there stay clean."""
from __future__ import annotations

import io

import pytest
import torch

from flexgen_sparpr import LLM
from flexgen_sparpr.utils.progress import bars_wanted, progress


class _Err(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty,quiet,want", [(True, False, True), (True, True, False), (False, False, False)])
def test_bars_only_on_a_terminal_and_not_quiet(monkeypatch, tty, quiet, want):
    monkeypatch.setattr("sys.stderr", _Err(tty))
    assert bars_wanted(quiet) is want


def test_a_bar_that_is_off_passes_its_items_and_prints_lines(capsys):
    bar = progress([1, 2, 3], enabled=False, desc="x")
    assert list(bar) == [1, 2, 3]
    bar.update()
    bar.write("a line")
    assert capsys.readouterr() == ("a line\n", "")


def test_generate_bars_go_to_stderr_only(tiny_opt_dir, tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 9, 3)]
    with LLM(str(tiny_opt_dir), gpu_batch_size=2, offload_dir=str(tmp_path / "off")) as llm:
        capsys.readouterr()
        quiet = llm.generate(prompts, 4, stop=None, progress=False)
        assert capsys.readouterr() == ("", "")  # off: nothing at all
        shown = llm.generate(prompts, 4, stop=None, progress=True)
    out, err = capsys.readouterr()
    assert out == "" and [o.token_ids for o in shown] == [o.token_ids for o in quiet]
    for bar in ("prefill", "decode", "generate"):  # the last: prompts done over the 2 batches
        assert bar in err, err
