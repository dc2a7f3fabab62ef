"""Every walkthrough in the docs is run by a test (tests/walkthrough.py): a block marked
``<!-- walkthrough: NAME -->`` without one, or a test naming a block that is gone, fails
here, in the fast tier."""

from __future__ import annotations

from walkthrough import REPO, RUN_BY, marked


def test_every_marked_walkthrough_has_its_test_and_back() -> None:
    blocks = marked()
    assert set(blocks) == set(RUN_BY), (sorted(blocks), sorted(RUN_BY))
    for name, test in RUN_BY.items():
        assert f'walkthrough("{name}")' in (REPO / test).read_text(), (name, test)


def test_the_readme_and_the_docs_each_hold_one() -> None:
    where = {doc.name for doc, _ in marked().values()}
    assert {"README.md", "engines.md"} <= where, where
