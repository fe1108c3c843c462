"""strata-run's output (runtime/cli.py): the continuation only (the prompt with --echo), streamed
for one sequence; --stop ends the text before the stop string with exit 0; --stop on a batch is
one usage error."""

from __future__ import annotations

from strata_compiler.cli_common import run_cli
from strata_compiler.runtime.cli import strata_run

PROMPT = "Once upon a time"


def _run(capsys, plan, *flags):
    code = run_cli(strata_run, [str(plan), "--prompt", PROMPT, "-n", "16", "--backend", "llvm", *flags])
    return code, capsys.readouterr()


def test_continuation_echo_and_stop(capsys, tiny_int8_plan):
    code, plain = _run(capsys, tiny_int8_plan)
    assert code == 0
    code, echoed = _run(capsys, tiny_int8_plan, "--echo")
    assert code == 0 and echoed.out == PROMPT + plain.out
    text = plain.out.rstrip("\n")
    word = text.split()[1]
    code, cut = _run(capsys, tiny_int8_plan, "--stop", word, "--stop", "never-in-the-text")
    assert code == 0 and cut.out == text[:text.index(word)] + "\n"


def test_stop_needs_one_sequence(capsys, tiny_int8_plan, tmp_path):
    import numpy as np

    np.save(tmp_path / "ids.npy", np.array([[5, 6, 7], [8, 9, 10]], np.int64))
    code = run_cli(strata_run, [str(tiny_int8_plan), "--input-ids", str(tmp_path / "ids.npy"), "-n", "2",
                                "--backend", "llvm", "--stop", "x"])
    err = capsys.readouterr().err
    assert code != 0 and "--stop" in err
