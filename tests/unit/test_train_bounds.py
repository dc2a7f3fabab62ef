"""Every training and DFlash setting carries its range beside it (synthq.training.config):
a value out of it is one line naming the option, as a generation setting's is (issue 41:
`synthq train JOB --epochs 1000000000000` was stored on the job and trained)."""

from __future__ import annotations

import inspect
import math
from dataclasses import fields

import pytest

from synthq.core.errors import UserError
from synthq.training.config import BOUNDS, TrainConfig, parse_when


def _refused(name: str, value: object) -> str:
    with pytest.raises(UserError) as caught:
        TrainConfig(**{name: value}).check()  # type: ignore[arg-type]
    return str(caught.value)


def test_every_setting_declares_a_range_or_choices_that_hold_its_default() -> None:
    assert set(BOUNDS) == {f.name for f in fields(TrainConfig)}
    for s in BOUNDS.values():
        if s.type in (int, float):
            assert s.low is not None and s.high is not None and math.isfinite(s.high), s.name
        else:
            assert s.type is str and s.default in s.choices, s.name
    TrainConfig().check()


@pytest.mark.parametrize("name", [n for n, s in BOUNDS.items() if s.type in (int, float)])
def test_each_number_is_taken_at_its_bounds_and_refused_past_them(name: str) -> None:
    s = BOUNDS[name]
    assert s.low is not None and s.high is not None
    flag = "--" + name.replace("_", "-")
    step = 1 if s.type is int else s.high / 1e6
    inside = [s.low + step if s.low_open else s.low, s.high - step if s.high_open else s.high]
    for value in inside:
        TrainConfig(**{name: s.type(value)}).check()  # type: ignore[arg-type]
    beyond = [s.low if s.low_open else s.low - step, s.high if s.high_open else s.high + step,
              10**12 if s.type is int else 1e308]
    for value in beyond:
        line = _refused(name, s.type(value))
        assert line.startswith(f"{flag} is out of range: {flag} must be "), line
        assert "\n" not in line
    if s.type is float:
        assert _refused(name, math.nan) == f"{flag} must be a number, got nan"
        for value in (math.inf, -math.inf):
            assert _refused(name, value).startswith(f"{flag} is out of range")
    else:
        assert _refused(name, 2.0).startswith(f"{flag} must be ")  # not an integer
    assert _refused(name, True).startswith(f"{flag} must be ")
    assert _refused(name, None) == f"{flag} is required"


def test_the_issues_values_are_refused_in_one_line() -> None:
    assert _refused("epochs", 10**12) == ("--epochs is out of range: --epochs must be a "
                                          "positive integer up to 10,000, got 1,000,000,000,000")
    assert _refused("lr", 1e308) == ("--lr is out of range: --lr must be above 0 and below 1, "
                                     "got 1e+308")
    assert _refused("batch_size", 0).startswith("--batch-size is out of range")
    assert _refused("draft_vocab_size", -1).startswith("--draft-vocab-size is out of range")
    assert _refused("drafter", "medusa") == "--drafter must be eagle3 or dflash, got 'medusa'"
    # A DFlash step seeds a generator with (seed * 1_000_003 + rank) * 1_000_033 + step:
    # a seed of 10**8 overflowed it (ValueError at the first step).
    assert _refused("seed", 10**8).startswith("--seed is out of range")


def test_the_cli_defaults_are_the_configs() -> None:
    """`synthq train` writes each default again in its signature: they must agree."""
    from synthq.cli.train import train

    params = inspect.signature(train).parameters
    shared = [n for n in BOUNDS if n in params]
    assert len(shared) >= 20
    for name in shared:
        assert params[name].default == BOUNDS[name].default, name


def test_train_when_counts_are_bounded() -> None:
    assert parse_when("count:1000000000").value == 1e9
    for text in ("count:1e308", "count:1000000001"):
        with pytest.raises(UserError, match=r"count:N \(1 <= N <= 1,000,000,000\)"):
            parse_when(text)
