"""bench/compare.py's arguments, its alternation and its ratio arithmetic (no benchmark runs)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compare() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_compare", ROOT / "bench" / "compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_arguments(compare: ModuleType) -> None:
    args = compare.parse_args(["main"])
    assert (args.rev, args.runs, args.no_stream, args.mode) == ("main", 3, False, "distributed")
    args = compare.parse_args(["abc123", "--runs", "5", "--no-stream", "--mode", "embedded"])
    assert (args.rev, args.runs, args.no_stream, args.mode) == ("abc123", 5, True, "embedded")


@pytest.mark.parametrize("argv", [[], ["main", "--runs", "0"], ["main", "--mode", "both"],
                                  ["main", "--samples", "3"]])
def test_bad_arguments_exit_2(compare: ModuleType, argv: list[str],
                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        compare.parse_args(argv)
    assert exc.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.processes
def test_an_unknown_revision_is_one_line(compare: ModuleType) -> None:
    with pytest.raises(SystemExit) as exc:
        compare.resolve("no-such-branch-or-commit-xyz")
    assert str(exc.value) == "compare: 'no-such-branch-or-commit-xyz' is not a commit of this " \
        "repository"


def test_the_order_alternates(compare: ModuleType) -> None:
    assert [compare.order(i) for i in range(4)] == [("rev", "tree"), ("tree", "rev")] * 2


def test_ratios_are_tree_over_rev_within_each_round(compare: ModuleType) -> None:
    Run = compare.Run
    rev = [Run(100.0, 4.0, 1.0), Run(200.0, 2.0, 1.0)]
    tree = [Run(150.0, 2.0, 1.0), Run(100.0, 3.0, 1.0)]
    q = compare.ratios(rev, tree)
    assert q == {"done_per_s": [1.5, 0.5], "cpu_per_sample": [0.5, 1.5]}
    assert compare.stats([1.5, 0.5, 1.0]) == (1.0, 0.5, 1.5)
    assert compare.fmt([1.5, 0.5, 1.0]) == "1.00 (0.50-1.50)"
    assert compare.fmt([1.234]) == "1.23"
    with pytest.raises(ValueError):
        compare.ratios(rev, tree[:1])


def test_figures_read_from_the_summary_line(compare: ModuleType) -> None:
    out = "some table\n" + json.dumps({"bench": "seed_scenario", "synthq_embedded": {
        "done_per_s": 210.5, "steady_done_per_s": 220.0, "cpu_ms_per_sample": 1.75}}) + "\n"
    assert compare.figures_of(out, "embedded") == (210.5, 1.75)
    with pytest.raises(ValueError):
        compare.figures_of("no json here\n", "embedded")
