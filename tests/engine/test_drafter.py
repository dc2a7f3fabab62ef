"""Trained drafters served by the real vLLM, each family by its own method: EAGLE-3
checkpoints its loader loads (draft vocabulary equal to the target's: no d2t; smaller:
d2t), and a DFlash drafter (``--drafter dflash``, reduced: one layer, blocks of 4 draft
tokens, ``method: dflash``); the acceptance vLLM's own counters measure on each run's
held-out prompts against synthq's estimate.

The module generates one job on the session engine's own answers and trains the drafters
its selected tests serve on it; each drafter's server starts as soon as its checkpoint is
written, so the cold starts (half a minute each, one core) overlap the next trainings and
each other instead of following them one by one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import child_env, run_cli

from synthq.testing.tiny import count_prompt, prompts
from synthq.testing.vllm import VllmServer, VllmStartError

# The first test also waits for the session's target and server and the module's job,
# trainings and servers (minutes on a busy machine): the suite's 300 s would cut it.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(2400),
              # the modules on the session's plain server, on one worker (scripts/test.sh):
              # one start
              pytest.mark.xdist_group("engine")]

#: How each drafter is trained on the module's job (``synthq train gen ...``).
TRAIN = {
    "equal": ["--draft-vocab-size", "100000", "--epochs", "3", "--batch-size", "8",
              "--lr", "2e-3"],
    "smaller": ["--draft-vocab-size", "128", "--epochs", "3", "--batch-size", "8",
                "--lr", "2e-3"],
    "dflash": ["--drafter", "dflash", "--dflash-layers", "1", "--ttt-steps", "4",
               "--draft-vocab-size", "100000", "--epochs", "3", "--batch-size", "8",
               "--lr", "2e-3"],
}
#: The drafters each test serves: only the selected tests' are trained and started.
SERVES = {
    "test_drafters_trained_on_vllm_data_are_served_by_vllm_eagle3": ("equal", "smaller"),
    "test_a_dflash_drafter_is_served_by_vllm_dflash": ("dflash",),
}


def _synthq(env: dict[str, str], *args: str) -> Any:
    out = run_cli(*args, check=False, env=env, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@dataclass
class Drafter:
    row: dict[str, Any]  # synthq train --json
    #: The --speculative-config its server was started with, and the server (started,
    #: not yet waited for); None when the run did not finish.
    spec: dict[str, Any] | None
    server: VllmServer | None


@dataclass
class Served:
    env: dict[str, str]  # the job's data directory
    status: dict[str, Any]  # synthq run --json of the job
    drafters: dict[str, Drafter]


@pytest.fixture(scope="module")
def served(engine: Any, tmp_path_factory: pytest.TempPathFactory,
           request: pytest.FixtureRequest) -> Iterator[Served]:
    """Job ``gen``: 400 counting prompts answered by the session's engine (64 tokens,
    temperature 0, vLLM's token ids); then each drafter the module's selected tests serve,
    trained on it and its server started at once."""
    from synthq.training.drafters import speculative_config

    root = tmp_path_factory.mktemp("drafters")
    env = child_env(SYNTHQ_DATA_DIR=str(root / "state"), SYNTHQ_DATABASE_URL="",
                    SYNTHQ_BROKER_URL="", OMP_NUM_THREADS="1")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"t{i}", "messages": [
        {"role": "user", "content": count_prompt(*p)}]}) + "\n"
        for i, p in enumerate(prompts(400, 77))))
    status = _synthq(env, "run", "-d", str(data), "-s", engine.url, "-m", engine.name,
                     "--job", "gen", "--id-field", "id", "--max-tokens", "64",
                     "--temperature", "0", "--tokenizer", str(engine.target),
                     "--max-seq-len", "256", "--return-token-ids", "--inflight", "16",
                     "--json")
    wanted = dict.fromkeys(label for item in request.session.items
                           if item.module is request.module
                           for label in SERVES.get(getattr(item, "originalname", ""), ()))
    drafters: dict[str, Drafter] = {}
    try:
        for label in wanted:
            row = _synthq(env, "train", "gen", "--target", str(engine.target), *TRAIN[label],
                          "--out", str(root / label), "--json")
            spec = server = None
            if row["state"] == "done":
                spec = speculative_config(row["checkpoint"], 4)
                server = VllmServer.start(engine.target, engine.name,
                                          log_path=root / f"vllm-{label}.log",
                                          speculative=spec)
            drafters[label] = Drafter(row, spec, server)
        yield Served(env, status, drafters)
    finally:
        for drafter in drafters.values():
            if drafter.server is not None:
                drafter.server.stop()


def test_drafters_trained_on_vllm_data_are_served_by_vllm_eagle3(
        engine: Any, served: Served) -> None:
    env, status = served.env, served.status
    assert status["token_mismatches"] == 0 and status["counts"]["done"] > 300, status

    runs = {}
    for label in ("equal", "smaller"):
        row = served.drafters[label].row
        assert row["state"] == "done", row
        runs[label] = row
    from safetensors import safe_open

    for label, row in runs.items():
        with safe_open(str(Path(row["checkpoint"]) / "model.safetensors"), "pt") as f:
            names = set(f.keys())  # noqa: SIM118 - safe_open has no __contains__
        assert ("d2t" in names) == (label == "smaller"), (label, sorted(names))

    # Each started by the module as soon as its run was done (each cold start is
    # minutes on this machine).
    servers: dict[str, VllmServer] = {}
    for label, row in runs.items():
        drafter = served.drafters[label]
        assert drafter.spec == {"method": "eagle3", "model": row["checkpoint"],
                                "num_speculative_tokens": 4}, drafter.spec
        assert drafter.server is not None
        servers[label] = drafter.server
    try:
        for label, server in servers.items():
            try:
                server.wait_ready(timeout=1200)
            except VllmStartError as exc:
                pytest.fail(f"vLLM did not load the {label}-vocabulary checkpoint: {exc}",
                            pytrace=False)
        for label, server in servers.items():
            check = _synthq(env, "serve-check", str(runs[label]["id"]), "-s",
                            server.base_url, "-m", engine.name, "--json")
            served_al, own = check["served_acceptance_length"], check["eval_acceptance_length"]
            assert check["engine"] == "vllm" and check["version"] == "0.32.0"
            assert check["drafts"] > 100, check
            assert served_al >= 2.0, (label, check)
            assert abs(served_al - own) <= 0.3, (label, check)
    finally:
        for server in servers.values():
            server.stop()
    # Stored on the runs, beside synthq's own estimate.
    listed = {r["id"]: r for r in _synthq(env, "runs", "gen", "--json")}
    for row in runs.values():
        stored = listed[row["id"]]
        assert stored["served_acceptance_length"] >= 2.0
        assert (stored["served_engine"], stored["served_engine_version"]) == ("vllm", "0.32.0")


def test_a_dflash_drafter_is_served_by_vllm_dflash(engine: Any, served: Served) -> None:
    """DFlash, trained on the engine's own answers (the module's job) and served by vLLM
    (``method: dflash``): it drafts, and what vLLM accepts equals synthq's own
    draft-and-verify figure (the same model computed the same way: mask, context, RoPE,
    aux layers)."""
    from synthq.training.drafters import speculative_config

    env, status = served.env, served.status
    assert status["token_mismatches"] == 0 and status["counts"]["done"] > 200, status
    drafter = served.drafters["dflash"]
    row = drafter.row
    assert (row["state"], row["drafter"]) == ("done", "dflash"), row
    ckpt = Path(row["checkpoint"])
    assert (ckpt / "mask_embedding.pt").is_file()

    spec = speculative_config(ckpt, 4)
    assert spec["method"] == "dflash"
    assert drafter.spec == spec and drafter.server is not None, drafter.spec
    server = drafter.server
    try:
        try:
            server.wait_ready(timeout=1200)
        except VllmStartError as exc:
            pytest.fail(f"vLLM did not load the DFlash checkpoint: {exc}", pytrace=False)
        log = server.log_path.read_text(errors="replace")
        assert "Loaded DFlash mask embedding for mask_token_id 0" in log
        assert "auxiliary layers from speculative config: (2, 4, 5)" in log
        check = _synthq(env, "serve-check", str(row["id"]), "-s", server.base_url,
                        "-m", engine.name, "--json")
    finally:
        server.stop()
    served_al, own = check["served_acceptance_length"], check["eval_acceptance_length"]
    print(f"DFlash served by vLLM: {served_al:.3f} ({check['accepted']} accepted of "
          f"{check['drafts']} drafts); synthq's own draft-and-verify: {own:.3f}")
    assert (check["engine"], check["version"], check["drafter"]) == ("vllm", "0.32.0", "dflash")
    assert check["drafts"] > 100, check
    assert served_al >= 1.5, check  # it drafts (an untrained one: about 1.0), not only loads
    assert abs(served_al - own) <= 0.1, check
    listed = {r["id"]: r for r in _synthq(env, "runs", "gen", "--json")}
    assert listed[row["id"]]["served_acceptance_length"] == served_al
    assert listed[row["id"]]["drafter"] == "dflash"
