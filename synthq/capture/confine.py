"""Which engine file a capture may read and delete: its own, or one confined to a folder.

synthq reads the file a capture server answers (``hidden_states_path``) and deletes it
once stored, so it must never take a path the server names at will. Two ways a file
is this request's:

* **named**: synthq's connector (``synthq_connector``) writes it as
  ``<synthq_name>.safetensors``, the name this request sent;
* **confined**: vLLM's stock ``ExampleHiddenStatesConnector`` names files by request
  id, which synthq cannot know. A capture server declared with an engine-files folder
  (``synthq capture JOB --engine-files URL=DIR``, the connector's
  ``shared_storage_path`` as this machine sees it) may answer any
  ``*.safetensors`` directly in that folder: not outside it, not through a symlink
  (the file itself or a folder on its way). The file's ``token_ids`` must still be
  the sample's (synthq.capture.ingest), so another request's file is refused too.

Anything else is ``bad_request``, and neither read nor deleted.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from synthq.errors import BadRequest, UserError

__all__ = ["check_folder", "accept"]


def check_folder(url: str, folder: str) -> Path:
    """The declared engine-files folder of capture server ``url``, checked: an absolute,
    existing directory that is no symlink (its real path is itself)."""
    path = Path(folder)
    if not path.is_absolute():
        raise UserError(f"--engine-files for {url}: {folder!r} is not an absolute path")
    if not path.is_dir():
        raise UserError(f"--engine-files for {url}: {folder} is not a folder on this machine "
                        "(the connector's shared_storage_path, as this machine sees it)")
    if os.path.realpath(path) != os.path.normpath(path):
        raise UserError(f"--engine-files for {url}: {folder} goes through a symlink; give "
                        f"its real path {os.path.realpath(path)}")
    return path


def accept(answered: Path, *, name: str, folder: str | None) -> Path:
    """The engine file a capture may read and delete, or :class:`BadRequest`."""
    if folder is None:
        if answered.name != f"{name}.safetensors":
            raise BadRequest(f"the server answered the file {answered.name!r}, not this "
                             f"request's {name}.safetensors: start it with synthq_connector, "
                             "or declare its engine-files folder (--engine-files URL=DIR)")
        return answered
    where = Path(folder)
    if not answered.is_absolute() or answered.parent != where or \
            not answered.name.endswith(".safetensors"):
        raise BadRequest(f"the server answered the file {str(answered)!r}, outside its "
                         f"engine-files folder {folder}: refused (neither read nor deleted)")
    if os.path.realpath(answered.parent) != os.path.normpath(where):
        raise BadRequest(f"the engine-files folder {folder} is reached through a symlink now: "
                         "refused")
    try:
        mode = os.lstat(answered).st_mode
    except FileNotFoundError:
        return answered  # not written yet: the wait for a whole file follows
    if stat.S_ISLNK(mode) or not stat.S_ISREG(mode):
        raise BadRequest(f"the server answered {str(answered)!r}, which is a symlink or not "
                         "a plain file: refused (neither read nor deleted)")
    return answered
