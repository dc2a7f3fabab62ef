"""``synthq train --supervise {assistant,all}``: which positions the loss learns.

No database: the config and the CLI's checks, the mask itself, the loss on a tiny
example, and the training loop's use of the setting (its step replaced by a recorder).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from synthq.core.errors import UserError
from synthq.training.config import TrainConfig

torch = pytest.importorskip("torch")


def _examples() -> list[Any]:
    """Two examples of unequal length (the shorter one padded in a batch): a 5- and a
    3-token prompt, then 3 and 2 generated (supervised) tokens."""
    from synthq.training.data import Example

    return [Example("a", np.arange(10, 18, dtype=np.int64),
                    np.array([0, 0, 0, 0, 0, 1, 1, 1], dtype=np.uint8)),
            Example("b", np.arange(20, 25, dtype=np.int64),
                    np.array([0, 0, 0, 1, 1], dtype=np.uint8))]


def test_config_stores_and_checks_supervise() -> None:
    assert TrainConfig().supervise == "assistant"  # the default: the old behaviour
    cfg = TrainConfig(supervise="all")
    cfg.check()
    assert TrainConfig.from_dict(cfg.to_dict()).supervise == "all"  # kept in the run's row
    with pytest.raises(UserError, match="supervise must be assistant or all"):
        TrainConfig(supervise="prompt").check()


def test_cli_passes_supervise_into_the_run_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import synthq.cli.train as cli_train
    from synthq.cli import app

    runner = CliRunner()
    assert "--supervise" in runner.invoke(app, ["train", "--help"]).output
    seen: list[dict[str, Any]] = []

    def config(opts: dict[str, Any]) -> Any:
        seen.append(opts)
        raise UserError("stop here")

    monkeypatch.setattr(cli_train, "_config", config)
    result = runner.invoke(app, ["train", "some-job", "--supervise", "all"])
    assert result.exit_code != 0 and seen and seen[0]["supervise"] == "all"
    monkeypatch.undo()
    bad = runner.invoke(app, ["train", "some-job", "--supervise", "prompt"])
    assert bad.exit_code != 0 and "supervise must be assistant or all" in bad.output


def test_all_supervises_every_real_position() -> None:
    from synthq.training.data import collate, step_mask, supervised

    ids, loss_mask, valid = collate(_examples(), [0, 1])
    assert torch.equal(supervised(loss_mask, valid, "assistant"), loss_mask)
    everything = supervised(loss_mask, valid, "all")
    assert torch.equal(everything, valid)
    # Step 0 at position i learns token i+2: rows of 8 and 5 real tokens give 6 and 3
    # positions (the padding after row b never), against 3 and 2 generated tokens.
    assert step_mask(everything, 0).sum(1).tolist() == [6, 3]
    assert step_mask(loss_mask, 0).sum(1).tolist() == [3, 2]
    with pytest.raises(ValueError):
        supervised(loss_mask, valid, "prompt")


def test_the_loss_differs_between_the_settings() -> None:
    """The same logits and features: ``all`` counts and weighs more positions."""
    from synthq.training.data import TargetFeatures, collate, supervised
    from synthq.training.loss import ttt_loss

    gen = torch.Generator().manual_seed(0)
    ids, loss_mask, valid = collate(_examples(), [0, 1])
    B, L, H, V, T = ids.shape[0], ids.shape[1], 8, 6, 32
    feats = TargetFeatures(aux=torch.zeros(B, L, 3 * H), last=torch.randn(B, L, H, generator=gen),
                           top=torch.randint(0, V, (B, L), generator=gen))  # all in the draft vocab
    head = torch.randn(V, H, generator=gen)
    d2t = torch.arange(V)
    t2d = torch.zeros(T, dtype=torch.bool)
    t2d[:V] = True
    logits = [torch.randn(B, L, V, generator=gen) for _ in range(3)]

    def loss(supervise: str) -> tuple[float, list[tuple[int, int]]]:
        total, stats = ttt_loss(logits, feats, supervised(loss_mask, valid, supervise), d2t,
                                0.8, head, t2d)
        return float(total), stats

    a_loss, a_stats = loss("assistant")
    all_loss, all_stats = loss("all")
    assert [n for _, n in a_stats] == [5, 5, 4]  # generated tokens at position 2+k or later
    assert [n for _, n in all_stats] == [9, 7, 5]  # real tokens at position 2+k or later
    assert a_loss != pytest.approx(all_loss)


@pytest.mark.parametrize("supervise", ["assistant", "all"])
def test_training_steps_use_the_setting(monkeypatch: pytest.MonkeyPatch,
                                        supervise: str) -> None:
    """The loop's steps hand the loss the mask the run's config asks for."""
    import synthq.training.loop as loop_mod
    from synthq.training.data import TargetFeatures, collate

    examples = _examples()
    cfg = TrainConfig(batch_size=2, epochs=1, supervise=supervise)
    masks: list[Any] = []  # [B, L] bool tensors

    def step(loop: Any, ids: Any, feats: Any, loss_mask: Any,
             done: int) -> tuple[Any, list[tuple[int, int]]]:
        masks.append(loss_mask.clone())
        return torch.zeros(()), [(0, 1)]

    def features(target: Any, ids: Any) -> TargetFeatures:
        B, L = ids.shape
        return TargetFeatures(aux=torch.zeros(B, L, 3), last=torch.zeros(B, L, 1),
                              top=torch.zeros(B, L, dtype=torch.long))

    monkeypatch.setattr(loop_mod, "_step", step)
    monkeypatch.setattr(loop_mod, "_after_step", lambda *a: None)
    monkeypatch.setattr(loop_mod, "target_features", features)
    loop = SimpleNamespace(ctx=SimpleNamespace(rank=0, world=1), cfg=cfg, examples=examples,
                           cache=None, target=None,
                           opt=SimpleNamespace(total=1, per_epoch=1,
                                               drafter=SimpleNamespace(train=lambda: None)))
    loop_mod._steps(loop, loop_mod._Progress(0, [], loop_mod._window(1)),  # type: ignore[arg-type]
                    None, None)  # type: ignore[arg-type]
    assert len(masks) == 1
    _, loss_mask, valid = collate(examples, [0, 1])
    # batches() may order the two rows either way: compare as sets of rows.
    want = valid if supervise == "all" else loss_mask
    assert sorted(map(tuple, masks[0].tolist())) == sorted(map(tuple, want.tolist()))
