"""`python tests/lab machines`: runs the state machines with fresh random cases and
fails loudly when an invariant breaks."""

from __future__ import annotations

import pytest
from hypothesis.stateful import invariant

from lab import machines_bench as machines
from lab.cli import build_parser
from lab.machines.adopter import AdopterMachine


def run_cli(argv: list[str]) -> int:
    args = build_parser().parse_args(["machines", *argv])
    return int(args.func(args))


def test_a_small_randomized_pass_holds_and_says_how_much_it_ran(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--machine", "adopter", "--examples", "4", "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "adopter" in out and "invariants held" in out
    ran = int(out.split("adopter", 1)[1].split("machines run", 1)[0])
    assert ran >= 4


def test_a_broken_invariant_fails_the_bench_with_the_shrunk_steps(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class Broken(AdopterMachine):
        @invariant()
        def no_request_admitted(self) -> None:
            assert self.requests == 0, "a request was admitted"

    monkeypatch.setattr(machines, "AdopterMachine", Broken)
    assert run_cli(["--machine", "adopter", "--examples", "30", "--steps", "8"]) == 1
    captured = capsys.readouterr()
    assert "invariants FAILED" in captured.out
    assert "a request was admitted" in captured.err
