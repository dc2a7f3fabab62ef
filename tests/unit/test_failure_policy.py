"""Each failure class's policy is decided once (synthq.core.errors.POLICY), for every class, and
the callers that act on it (the down rule, the adaptive controller, the streaks) read it
there: a caller that keeps a list of its own and drifts fails here."""

from __future__ import annotations

import pytest

from synthq.core import errors
from synthq.core.errors import POLICY, Down, FailureClass, Load, Stage
from synthq.queue import outage, streaks
from synthq.serving import controller


def concrete(root: type[errors.SampleError] = errors.SampleError) -> list[type[errors.SampleError]]:
    """Every exception class below ``root`` that names a class of its own (not the
    abstract ``RetryableError`` and ``PermanentError``, whose class is ``error``)."""
    found, todo = [], [root]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.error_class != root.error_class:
            found.append(cls)
    return found


def test_every_class_has_every_property_decided() -> None:
    assert set(POLICY) == set(FailureClass)
    for member, policy in POLICY.items():
        assert isinstance(policy.retryable, bool), member
        assert isinstance(policy.load, Load), member
        assert isinstance(policy.down, Down), member
        assert isinstance(policy.streak, frozenset), member
        assert all(isinstance(s, Stage) for s in policy.streak), member
        assert (member.retryable, member.load, member.down, member.streak) == (
            policy.retryable, policy.load, policy.down, policy.streak)


def test_the_members_are_the_exception_tree() -> None:
    """One member per class that an exception stores, retryable where its exception is."""
    classes = concrete()
    assert {cls.error_class for cls in classes} == set(FailureClass)
    assert set(FailureClass) == errors.ALL_CLASSES - {errors.SampleError.error_class}
    for cls in classes:
        assert FailureClass(cls.error_class).retryable is cls.retryable, cls.__name__


def test_of_names_failures_only() -> None:
    assert FailureClass.of("timeout") is FailureClass.TIMEOUT
    assert [FailureClass.of(n) for n in ("ok", None, "error", "nonsense")] == [None] * 4


@pytest.mark.parametrize("member", list(FailureClass))
def test_the_down_rule_reads_the_policy(member: FailureClass) -> None:
    """An HTTP 5xx answer counts where the class's rule says it may; another HTTP status,
    or a message that is no HTTP answer (a broken stream), only where the class always
    counts."""
    assert outage.says_down(member, "HTTP 503: busy") is (member.down is not Down.NEVER)
    for other in ("HTTP 400: no", "HTTP 408: slow", "malformed stream chunk"):
        assert outage.says_down(member, other) is (member.down is Down.UNANSWERED), other
    assert (member in outage.DOWN_OUTCOMES) is (member.down is Down.UNANSWERED)


def test_the_down_rule_ignores_what_is_no_failure() -> None:
    assert not any(outage.says_down(o, "HTTP 503: busy") for o in ("ok", None, "error"))


@pytest.mark.parametrize("member", list(FailureClass))
def test_the_adaptive_controller_reads_the_policy(member: FailureClass) -> None:
    """One call that ended in the window with ``member``: counted as overload, as a
    timeout, or as neither, as its :attr:`FailureClass.load` says."""
    w = controller.summarize([(0.0, 1.0, member.value, 1.0, 0.5, None)], now=1.0, limit=4,
                             inflight=0, since=0.0)
    assert w.overload == (member.load is Load.OVERLOAD)
    assert w.timeouts == (member.load is Load.TIMEOUT)
    assert w.server_errors == (member is FailureClass.SERVER_ERROR)
    assert w.ok == 0


@pytest.mark.parametrize("stage, classes", [(Stage.GENERATION, streaks.GENERATION_CLASSES),
                                            (Stage.CAPTURE, streaks.CAPTURE_CLASSES)])
@pytest.mark.parametrize("member", list(FailureClass))
def test_the_streaks_read_the_policy(member: FailureClass, stage: Stage,
                                     classes: frozenset[str]) -> None:
    """A stage's streak counts exactly the classes whose policy names that stage."""
    stop = streaks.Streaks(classes, after=1).failed("A", member.value, "HTTP 400: no")
    assert (stop is not None) is (stage in member.streak)
