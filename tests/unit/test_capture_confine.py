"""Issue 41, items 2-5 and the low items: every engine file a capture reads is reached
through its folder's descriptor (no symlink, planted before or after the answer; no
FIFO; no component that is not a folder), sized before it is read, judged by its
header before its tensors, and refused when its states are not finite. Real files,
FIFOs and symlinks; the RSS of a 1 GiB sparse file measured in a child process."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from synthq.capture import confine, files, ingest
from synthq.capture.store import Store
from synthq.core.errors import BadRequest, CaptureIncomplete, CaptureMismatch, SampleError

IDS = np.array([3, 1, 4, 1, 5], dtype="<i4")
LAYERS = [2, 3, 4]
NAME = "synthq-1-2-abc"


def _capture_file(path: Path, ids: np.ndarray = IDS, *, hidden: np.ndarray | None = None) -> None:
    """A capture file in the connector's layout (no checksum: the tests change values)."""
    states = hidden if hidden is not None else \
        np.random.default_rng(0).standard_normal((len(ids), len(LAYERS), 8)).astype("<f4")
    tensors = {"hidden_states": files.Tensor("F32", states.shape, states.tobytes()),
               "token_ids": files.Tensor("I64", (len(ids),), ids.astype("<i8").tobytes())}
    path.write_bytes(files.dumps(tensors, {}))


def _raw_file(path: Path, header: bytes, body: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)


def test_a_path_through_a_file_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """Item 2: ``/etc/hostname/<name>.safetensors`` (a component that is a file): before,
    the cleanup raised NotADirectoryError and ``synthq capture`` exited with a traceback."""
    (tmp_path / "hostname").write_text("host\n")
    answered = tmp_path / "hostname" / f"{NAME}.safetensors"
    with pytest.raises(BadRequest, match="is not a folder") as caught:
        confine.accept(answered, name=NAME, folder=None)
    assert "\n" not in str(caught.value)
    ingest.discard(answered)  # the cleanup of such a path raises nothing either
    assert (tmp_path / "hostname").read_text() == "host\n"


def test_a_folder_reached_through_a_symlink_is_refused(tmp_path: Path) -> None:
    """Item 2: without --engine-files a server named any folder, symlinks followed."""
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "real")
    _capture_file(tmp_path / "real" / f"{NAME}.safetensors")
    with pytest.raises(BadRequest, match="is a symlink"):
        confine.accept(tmp_path / "via" / f"{NAME}.safetensors", name=NAME, folder=None)
    assert (tmp_path / "real" / f"{NAME}.safetensors").exists()


def test_without_a_declared_folder_the_server_keeps_its_first_folder(tmp_path: Path) -> None:
    """Item 2: a server may not answer one file here and the next one elsewhere."""
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    pins = confine.Pins()
    first = confine.accept(tmp_path / "a" / f"{NAME}.safetensors", name=NAME, folder=None,
                           server="s", pins=pins)
    first.folder.close()
    with pytest.raises(BadRequest, match="its files were in"):
        confine.accept(tmp_path / "b" / f"{NAME}.safetensors", name=NAME, folder=None,
                       server="s", pins=pins)
    other = confine.accept(tmp_path / "b" / f"{NAME}.safetensors", name=NAME, folder=None,
                           server="t", pins=pins)  # another server has its own
    other.folder.close()


@pytest.mark.parametrize("declared", [True, False])
def test_a_symlink_planted_after_the_answer_is_not_followed(tmp_path: Path,
                                                            declared: bool) -> None:
    """Item 3: the path did not exist when the server answered; a symlink to a valid file
    with the sample's ids is planted before the read. Before, it was read and stored."""
    engine = tmp_path / "engine"
    engine.mkdir()
    victim = tmp_path / "victim.safetensors"
    _capture_file(victim)
    answered = engine / f"{NAME}.safetensors"
    file = confine.accept(answered, name=NAME, folder=str(engine) if declared else None)
    answered.symlink_to(victim)  # between the answer and the read
    with pytest.raises(BadRequest, match="symlink"):
        ingest.wait_whole(file, timeout=5)
    with pytest.raises(BadRequest, match="symlink"):
        ingest.check(file, input_ids=IDS, layers=LAYERS)
    ingest.discard(file)
    assert victim.exists() and not answered.is_symlink()  # the link went, not its target


def test_a_fifo_lock_does_not_block_the_wait(tmp_path: Path) -> None:
    """Item 5: a FIFO ``.lock`` beside a whole file blocked ``open()`` for good."""
    path = tmp_path / f"{NAME}.safetensors"
    _capture_file(path)
    os.mkfifo(f"{path}.lock")
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            ingest.wait_whole(path, timeout=2)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(10)
    if thread.is_alive():  # the old code: blocked in open(); let it go, then fail
        fd = os.open(f"{path}.lock", os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        thread.join(5)
        pytest.fail("the wait for the file blocked on its FIFO lock")
    assert isinstance(outcome[0], BadRequest), outcome
    assert "a FIFO" in str(outcome[0])
    assert time.monotonic() - started < 5


def test_a_fifo_or_a_hard_link_in_the_files_place_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / f"{NAME}.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(BadRequest, match="a FIFO"):
        ingest.check(fifo, input_ids=IDS, layers=LAYERS)
    fifo.unlink()
    elsewhere = tmp_path / "elsewhere.safetensors"
    _capture_file(elsewhere)
    os.link(elsewhere, fifo)
    with pytest.raises(BadRequest, match="2 links"):
        ingest.check(fifo, input_ids=IDS, layers=LAYERS)


# VmHWM, not getrusage: ru_maxrss carries the parent's peak across fork and exec.
_RSS_CHILD = """
import sys
from pathlib import Path
import numpy as np
from synthq.capture import ingest
from synthq.core.errors import SampleError
try:
    ingest.check(Path(sys.argv[1]), input_ids=np.array([3, 1, 4, 1, 5], dtype="<i4"),
                 layers=[2, 3, 4])
    print("ACCEPTED")
except SampleError as exc:
    print(exc.error_class)
except Exception as exc:
    print(type(exc).__name__)
print(next(int(line.split()[1]) // 1024 for line in open("/proc/self/status")
           if line.startswith("VmHWM:")))
"""


@pytest.mark.processes
def test_a_1gib_sparse_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """Item 4: the engine's file was read whole before any size check: a 1 GiB sparse
    file cost 1,125 MiB of RSS. It is now sized against tokens × layers × hidden first."""
    path = tmp_path / f"{NAME}.safetensors"
    _capture_file(path)
    with open(path, "r+b") as f:
        f.truncate(1 << 30)
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(path)], capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    verdict, rss_mb = out[0], int(out[1])
    print(f"\n1 GiB sparse engine file: {verdict}, max RSS {rss_mb} MB")
    assert verdict == "capture_mismatch", out
    assert rss_mb <= 300, rss_mb


def test_a_shape_that_overflows_or_a_nested_header_is_a_capture_error(tmp_path: Path) -> None:
    """Low item: both were ``server_error`` with a traceback (OverflowError in numpy's
    product, RecursionError in json), not a capture error."""
    path = tmp_path / "e.safetensors"
    cases = {
        "overflow": json.dumps({"hidden_states": {"dtype": "F32", "shape": [10**30, 10**30, 8],
                                                  "data_offsets": [0, 16]},
                                "token_ids": {"dtype": "I64", "shape": [5],
                                              "data_offsets": [16, 56]}}).encode(),
        "wraps": json.dumps({"hidden_states": {"dtype": "F32", "shape": [2**62, 4, 0 + 1],
                                               "data_offsets": [0, 0]},
                             "token_ids": {"dtype": "I64", "shape": [5],
                                           "data_offsets": [0, 40]}}).encode(),
        "nested": b'{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
    }
    for case, header in cases.items():
        _raw_file(path, header, b"\0" * 64)
        with pytest.raises(SampleError) as caught:
            ingest.check(path, input_ids=IDS, layers=LAYERS)
        assert caught.value.error_class == "capture_mismatch", (case, caught.value)
        assert "\n" not in str(caught.value)


def test_non_finite_states_are_refused_not_stored(tmp_path: Path) -> None:
    """Low item: NaN and Inf states were stored, exported and trained on (and in float8
    one Inf clipped the whole tensor's scale)."""
    store = Store(tmp_path / "store")
    for bad in (np.nan, np.inf, -np.inf):
        states = np.ones((len(IDS), len(LAYERS), 8), dtype="<f4")
        states[2, 1, 5] = bad
        path = tmp_path / "e.safetensors"
        _capture_file(path, hidden=states)
        for dtype in ("float32", "float8_e4m3"):
            with pytest.raises(CaptureMismatch, match="1 NaN or infinite"):
                ingest.ingest(path, input_ids=IDS, layers=LAYERS, dtype=dtype, store=store,
                              metadata={})
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("*.*"))
    # bf16 and f16 are read from their bits.
    for code, raw in (("BF16", np.array([0x3F80, 0x7FC0], "<u2")),
                      ("F16", np.array([0x3C00, 0x7C00], "<u2"))):
        assert files.nonfinite(files.Tensor(code, (2,), raw.tobytes())) == 1


def test_a_file_within_its_bounds_is_still_taken(tmp_path: Path) -> None:
    """The bounds refuse nothing a connector writes: a whole file of the sample's ids."""
    path = tmp_path / f"{NAME}.safetensors"
    _capture_file(path)
    got = ingest.check(path, input_ids=IDS, layers=LAYERS, hidden=8)
    assert got.shape == (5, 3, 8)
    with pytest.raises(CaptureMismatch, match="hidden size of 8, over the 4 of the target"):
        ingest.check(path, input_ids=IDS, layers=LAYERS, hidden=4)
    path.write_bytes(path.read_bytes()[:-4])  # cut: retried, not refused
    with pytest.raises(CaptureIncomplete, match="not whole"):
        ingest.check(path, input_ids=IDS, layers=LAYERS)
