"""Which engine file a capture may read and delete, and how it is reached.

synthq reads the file a capture server answers (``hidden_states_path``) and deletes it
once stored, so it must never take a path the server names at will. Two ways a file
is this request's:

* **declared folder**: a capture server declared with an engine-files folder
  (``synthq capture JOB --engine-files URL=DIR``, the connector's ``shared_storage_path``
  as this machine sees it) may answer any ``*.safetensors`` directly in that folder
  (vLLM's stock ``ExampleHiddenStatesConnector`` names files by request id, which
  synthq cannot know). The file's ``token_ids`` must still be the sample's
  (synthq.capture.ingest), so another request's file is refused too.
* **named, no declared folder**: synthq's connector (``synthq_connector``) writes
  ``<synthq_name>.safetensors``, the name this attempt sent, with a random part no
  other file can have had before the request. Its folder is the first one the server
  answers in this stage (:class:`Pins`): a later answer in another folder is refused.
  So the only file synthq reads or deletes there is one made for this request, in the
  one folder this server writes to.

Either way the file is reached only through descriptors: its folder is opened one
component at a time from ``/`` with ``O_NOFOLLOW`` (no symlink on the way, and a
component that is not a folder, ``/etc/hostname/x.safetensors``, is a one-line
refusal), and the file from the folder's descriptor with ``O_NOFOLLOW | O_NONBLOCK``
(a symlink planted after the answer is refused at the open, never followed; a FIFO
does not block), then ``fstat``: a plain file with one link (no hard link to a file
elsewhere) and no larger than the caller's bound, before a byte is read. It is
deleted by name in that same folder descriptor (``unlink(name, dir_fd=...)``).

Anything else is ``bad_request`` (the server's configuration), and is neither read
nor deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
from pathlib import Path

from synthq.core.errors import BadRequest, CaptureMismatch, UserError

__all__ = ["check_folder", "accept", "Folder", "EngineFile", "Pins", "local"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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


class Folder:
    """A folder held open by its descriptor, reached from ``/`` with no symlink on the way.

    Everything in it is then opened, looked at and deleted relative to that descriptor:
    renaming or replacing a folder on the path later changes nothing that is read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = _open_folder(path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def lstat(self, name: str) -> os.stat_result | None:
        """``name``'s own status (a symlink is not followed); None when it is absent."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def open(self, name: str, *, most: int | None = None) -> int:
        """A descriptor of ``name``, a plain file with one link of at most ``most`` bytes;
        :class:`BadRequest` for a symlink, a FIFO, a device, a folder or a hard link,
        :class:`CaptureMismatch` for a file over ``most``; FileNotFoundError when absent."""
        where = self.path / name
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise BadRequest(f"{str(where)!r} is a symlink: refused (neither read nor "
                                 "deleted)") from None
            if exc.errno == errno.ENOENT:
                raise
            raise BadRequest(f"{str(where)!r} cannot be opened: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadRequest(f"{str(where)!r} is not a plain file ({_kind(st.st_mode)}): "
                                 "refused (neither read nor deleted)")
            if st.st_nlink != 1:
                raise BadRequest(f"{str(where)!r} has {st.st_nlink} links (a hard link to "
                                 "another file?): refused (neither read nor deleted)")
            if most is not None and st.st_size > most:
                raise CaptureMismatch(
                    f"the engine's file {str(where)!r} is {st.st_size:,} bytes, over the "
                    f"{most:,} its tokens, layers and hidden size can take: not read")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def unlink(self, name: str) -> None:
        """Delete ``name`` in this folder (a symlink itself, never what it points to)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


def _open_folder(path: Path) -> int:
    """``path`` opened one component at a time with ``O_NOFOLLOW``; :class:`BadRequest`
    in one line when a component is a symlink, not a folder, or absent."""
    if not path.is_absolute() or ".." in path.parts:
        raise BadRequest(f"the engine's folder {str(path)!r} is not an absolute, plain path")
    fd = os.open("/", _DIR_FLAGS)
    try:
        for i, part in enumerate(path.parts[1:], start=1):
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                at = Path(*path.parts[:i + 1])
                code = exc.errno or 0
                if code == errno.ENOTDIR and _is_link(part, fd):  # O_DIRECTORY answers first
                    code = errno.ELOOP
                why = {errno.ELOOP: "is a symlink", errno.ENOTDIR: "is not a folder",
                       errno.ENOENT: "does not exist on this machine"}.get(
                    code, f"cannot be opened ({exc.strerror})")
                raise BadRequest(f"the engine's file is answered in {str(path)!r}, but "
                                 f"{str(at)!r} {why}: refused (neither read nor deleted)") \
                    from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


class EngineFile:
    """One engine file a capture may read and delete: a name in an open :class:`Folder`."""

    def __init__(self, folder: Folder, name: str) -> None:
        self.folder = folder
        self.name = name

    @property
    def path(self) -> Path:
        return self.folder.path / self.name

    @property
    def lock(self) -> str:
        """The stock connector's lock file beside it, held while it writes."""
        return f"{self.name}.lock"

    def __str__(self) -> str:
        return str(self.path)

    def present(self) -> bool:
        """Whether the file is there; :class:`BadRequest` when something other than a
        plain file is (a symlink planted under its name is refused, not waited on)."""
        st = self.folder.lstat(self.name)
        if st is None:
            return False
        if not stat.S_ISREG(st.st_mode):
            raise BadRequest(f"{str(self.path)!r} is {_kind(st.st_mode)}: refused (neither "
                             "read nor deleted)")
        return True

    def unlocked(self) -> bool:
        """Whether no writer holds the lock beside the file (none there: True). Opened
        without blocking and looked at before it is locked: a FIFO is refused at once."""
        try:
            fd = self.folder.open(self.lock)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    def open(self, *, most: int | None = None) -> int:
        return self.folder.open(self.name, most=most)

    def discard(self) -> None:
        """Delete the file and its lock, in its folder's descriptor."""
        self.folder.unlink(self.name)
        self.folder.unlink(self.lock)


class Pins:
    """Each server's folder, pinned at its first answer when no folder is declared
    (thread-safe): synthq's connector writes every file to its one ``shared_storage_path``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._folders: dict[str, Path] = {}

    def check(self, server: str, folder: Path) -> None:
        """Pin ``folder`` for ``server``, or :class:`BadRequest` when another is pinned."""
        with self._lock:
            pinned = self._folders.setdefault(server, folder)
        if pinned != folder:
            raise BadRequest(f"the server answered a file in {str(folder)!r}, but its files "
                             f"were in {str(pinned)!r}: refused (neither read nor deleted; "
                             "declare its folder with --engine-files URL=DIR)")


def accept(answered: Path, *, name: str, folder: str | None, server: str = "",
           pins: Pins | None = None) -> EngineFile:
    """The engine file a capture may read and delete, its folder open, or
    :class:`BadRequest` (in one line, nothing read or deleted)."""
    if not answered.is_absolute() or ".." in answered.parts or answered.name in ("", "..") \
            or "\0" in str(answered):
        raise BadRequest(f"the server answered the file {str(answered)!r}, not an absolute "
                         "path: refused (neither read nor deleted)")
    if folder is None:
        if answered.name != f"{name}.safetensors":
            raise BadRequest(f"the server answered the file {answered.name!r}, not this "
                             f"request's {name}.safetensors: start it with synthq_connector, "
                             "or declare its engine-files folder (--engine-files URL=DIR)")
        if pins is not None:
            pins.check(server, answered.parent)
    elif answered.parent != Path(folder) or not answered.name.endswith(".safetensors"):
        raise BadRequest(f"the server answered the file {str(answered)!r}, outside its "
                         f"engine-files folder {folder}: refused (neither read nor deleted)")
    opened = Folder(answered.parent)
    file = EngineFile(opened, answered.name)
    try:
        file.present()  # a symlink or a FIFO under the name already: refused now
    except BaseException:
        opened.close()
        raise
    return file


def local(path: Path) -> EngineFile:
    """An engine file named by synthq itself (tests, tools): its folder opened the same way."""
    path = Path(os.path.realpath(path))
    return EngineFile(Folder(path.parent), path.name)
