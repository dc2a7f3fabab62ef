"""``--capture inline`` (issue 43 item 3), its pure parts: the example made of the
engine's ids, the final call's file taken piece by piece (synthq.capture.inline.take),
and the job settings it needs. The whole path runs against a real vLLM in
tests/engine/test_capture.py."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest

from synthq.capture import confine, files, inline
from synthq.core import errors
from synthq.core.errors import UserError
from synthq.data.examples import engine_example

LAYERS = [2, 4, 5, 8]
HIDDEN = 8


def test_the_engine_example_is_its_prompt_then_its_output_supervised() -> None:
    ex = engine_example([0, 5, 6], [7, 8, 1], max_seq_len=100)
    assert ex.input_ids.tolist() == [0, 5, 6, 7, 8, 1]
    assert ex.loss_mask.tolist() == [0, 0, 0, 1, 1, 1] and not ex.truncated
    cut = engine_example([0, 5, 6], [7, 8, 1], max_seq_len=4)
    assert cut.input_ids.tolist() == [0, 5, 6, 7] and cut.loss_mask.tolist() == [0, 0, 0, 1]
    with pytest.raises(errors.NoSupervisedTokens):
        engine_example([0, 5, 6], [7, 8, 1], max_seq_len=3)


def _engine_file(folder: Path, seen: list[int], name: str = "synthq-1-2-ab-inline"
                 ) -> tuple[confine.EngineFile, np.ndarray]:
    """A file as synthq's connector writes it: the states of ``seen`` (a row's values its
    position), its token ids."""
    states = np.repeat(np.arange(len(seen), dtype=np.float32), len(LAYERS) * HIDDEN) \
        .reshape(len(seen), len(LAYERS), HIDDEN)
    path = folder / f"{name}.safetensors"
    path.write_bytes(files.dumps({
        "hidden_states": files.Tensor("F32", states.shape, states.tobytes()),
        "token_ids": files.Tensor("I64", (len(seen),),
                                  np.asarray(seen, dtype="<i8").tobytes())}, {}))
    return confine.local(path), states


def test_each_piece_that_begins_the_final_calls_ids_takes_its_rows(tmp_path: Path) -> None:
    engine_ids = np.array([0, 10, 11, 12, 13, 14, 1])  # the final call: prompt then output
    engine_file, states = _engine_file(tmp_path, engine_ids[:-1].tolist())
    # An earlier turn's example (a prefix), one that is not, and the final example (the
    # engine's ids: its last token has no state).
    pieces = [np.array([0, 10, 11]), np.array([0, 99]), engine_ids]
    taken = inline.take(engine_file, engine_ids, pieces, layers=LAYERS, hidden=HIDDEN,
                        deadline=time.monotonic() + 5)
    first, other, last = taken
    assert first is not None and first[1].tolist() == [0, 10, 11]
    assert np.array_equal(first[0].array(), states[:3])
    assert other is None
    assert last is not None and last[1].tolist() == engine_ids[:-1].tolist()
    assert np.array_equal(last[0].array(), states)
    # Only the final example may lack its last token's state.
    short = inline.take(engine_file, engine_ids, [engine_ids, engine_ids], layers=LAYERS,
                        hidden=HIDDEN, deadline=time.monotonic() + 5)
    assert short[0] is None and short[1] is not None


def test_a_file_of_other_ids_or_none_by_the_deadline_is_not_taken(tmp_path: Path) -> None:
    engine_ids = np.array([0, 10, 11, 1])
    other, _ = _engine_file(tmp_path, [0, 10, 12])
    with pytest.raises(errors.CaptureMismatch):
        inline.take(other, engine_ids, [engine_ids], layers=LAYERS, hidden=HIDDEN,
                    deadline=time.monotonic() + 5)
    missing = confine.local(tmp_path / "synthq-9-9-cd-inline.safetensors")
    started = time.monotonic()
    with pytest.raises(errors.CaptureIncomplete):
        inline.take(missing, engine_ids, [engine_ids], layers=LAYERS, hidden=HIDDEN,
                    deadline=time.monotonic() + 0.3)
    assert time.monotonic() - started < 3


def test_capture_inline_needs_examples_that_supervise_the_final_answer(tmp_path: Path) -> None:
    from synthq.jobs.enqueue import JobSpec

    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text("{}")
    spec = JobSpec(name="j", model="m", servers=["http://h:1/v1"], tokenizer=str(tokenizer),
                   capture_mode="inline")
    assert spec.capture_servers == ["http://h:1/v1"]  # the generation server captures
    spec.check()
    for changes, said in (({"tokenizer": None}, "needs --tokenizer"),
                          ({"mask": "all_assistant_turns"}, "--mask last_turn"),
                          ({"regenerate": "all", "mask": "all_assistant_turns"},
                           "--examples per-turn")):
        with pytest.raises(UserError, match=said):
            dataclasses.replace(spec, **changes).check()
    dataclasses.replace(spec, regenerate="all", mask="all_assistant_turns",
                        examples="per-turn").check()


def test_training_reads_an_inline_capture_one_token_short_as_a_last_zero_row(
        tmp_path: Path) -> None:
    """A capture taken from the answer's call ends one token short (the engine never
    computed the last generated token's state): training reads the example whole, its
    last row zeros (never supervised); a capture short anywhere else is refused."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file

    from synthq.training.captured import CapturedFeatures, TargetHead
    from synthq.training.data import Example

    ids = np.array([0, 5, 6, 7, 1])
    states = torch.arange(4 * len(LAYERS) * HIDDEN, dtype=torch.float32).reshape(
        4, len(LAYERS), HIDDEN) + 1
    path = tmp_path / "c.safetensors"
    save_file({"hidden_states": states, "token_ids": torch.from_numpy(ids[:-1])}, str(path))
    head = TargetHead(config=SimpleNamespace(rms_norm_eps=1e-6), embed=torch.zeros(8, HIDDEN),
                      norm=torch.ones(HIDDEN), head=torch.randn(8, HIDDEN))
    example = Example("1", ids, np.array([0, 0, 1, 1, 1], dtype=np.uint8))
    got = CapturedFeatures({"1": (path, 0)}, head).read(example)
    assert got["aux"].shape == (5, 3 * HIDDEN)
    assert torch.equal(got["aux"][:4], states[:, :3].reshape(4, -1))
    assert not got["aux"][4].any()
    other = Example("1", np.array([0, 5, 6, 9, 1]), example.loss_mask)
    with pytest.raises(UserError, match="differ from its input_ids"):
        CapturedFeatures({"1": (path, 0)}, head).read(other)
    # Two tokens short is no inline capture: refused.
    longer = Example("1", np.array([0, 5, 6, 7, 1, 2]), np.ones(6, dtype=np.uint8))
    with pytest.raises(UserError, match="differ from its input_ids"):
        CapturedFeatures({"1": (path, 0)}, head).read(longer)


def test_the_jobs_old_inline_files_are_found_and_deleted_in_their_folder(
        tmp_path: Path) -> None:
    """A call whose answer was not kept (cut, retried) left its file: the job's inline
    files older than the file timeout are the stage's candidates; other jobs' files, new
    ones and other names are not."""
    import os

    old = time.time() - 120
    for name in ("synthq-7-1-aa-inline", "synthq-7-2-bb-inline", "synthq-8-1-cc-inline",
                 "synthq-7-3-dd", "synthq-7-4-ee-inline"):
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(b"x")
        if name != "synthq-7-4-ee-inline":  # written just now: its answer may be on its way
            os.utime(path, (old, old))
    (tmp_path / "synthq-7-1-aa-inline.safetensors.lock").write_bytes(b"")
    found = sorted(inline.orphans(tmp_path, 7, older_than=60))
    assert found == ["synthq-7-1-aa-inline", "synthq-7-2-bb-inline"]
    inline.discard(tmp_path, found[:1])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "synthq-7-2-bb-inline.safetensors", "synthq-7-3-dd.safetensors",
        "synthq-7-4-ee-inline.safetensors", "synthq-8-1-cc-inline.safetensors"]


def test_a_per_turn_samples_last_example_is_the_engines_and_its_count_says_so() -> None:
    """``--regenerate all --examples per-turn``: the last turn's example is replaced by the
    engine's ids, and ``samples.examples`` counts its tokens (the capture stage splits the
    sample's ids by them)."""
    from types import SimpleNamespace

    import chat_tokenizers

    from synthq.core.packing import unpack_ids
    from synthq.data.examples import tokenize_sample

    job = SimpleNamespace(tokenizer=chat_tokenizers.deepseek_v3(), chat_template=None,
                          chat_template_kwargs=None, max_seq_len=4096, reasoning="drop",
                          mask="all_assistant_turns", think_open="<think>\n",
                          think_close="\n</think>\n\n", regenerate="all", examples="per-turn",
                          history_reasoning="drop", tokenize_version=1)
    prompt = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "x"},
              {"role": "user", "content": "two"}]
    answers = [{"content": "first answer", "finish_reason": "stop"},
               {"content": "second answer", "finish_reason": "stop"}]
    engine = ([0, 11, 12, 13, 14], [21, 22, 1])
    got = tokenize_sample(job, prompt, "second answer", None, None, answers=answers,
                          engine_ids=engine)
    ids = unpack_ids(got["input_ids"])
    assert ids is not None and got["examples"][-1]["tokens"] == 8
    assert sum(e["tokens"] for e in got["examples"]) == len(ids) == got["num_tokens"]
    assert ids[-8:].tolist() == [*engine[0], *engine[1]]
    assert got["examples"][-1]["supervised"] == 3
