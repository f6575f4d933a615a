"""The export's output files: the destination checked before any work, a temporary folder beside it
(``.OUT.partial-PID-*``) that the last stage renames into place, and the sweep of folders left by
exports that were killed. Nothing half-written is ever at the destination."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tome_compile.errors import ToMeExportError

__all__ = ["check_output_path", "partial_prefix", "remove_temp_folder", "sweep_stale_partials", "temp_folder",
           "write_error"]

logger = logging.getLogger("tome_compile.export")


def check_output_path(out: str | Path, force: bool) -> Path:
    """Validate the destination before any work: suffix, folder, overwrite policy."""
    out = Path(out)
    if out.suffix != ".onnx":
        raise ToMeExportError(f"output {str(out)!r} must end in .onnx")
    parent = out.parent  # "." for a bare file name
    if not parent.is_dir():
        raise ToMeExportError(f"output folder {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ToMeExportError(f"output folder {str(parent)!r} is not writable")
    for existing in (out, out.with_name(out.name + ".data")):
        if existing.exists() and not force:
            raise ToMeExportError(f"{str(existing)!r} exists; pass --force (force=True) to overwrite it")
    return out


def partial_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def sweep_stale_partials(out: Path) -> list[Path]:
    """Remove temp folders of earlier exports to ``out`` whose process is gone (killed for memory,
    SIGKILL): ``.OUT.partial-PID-*``. Folders of a live export are left alone. Returns the removed."""
    parent = out.parent  # "." for a bare file name
    removed = []
    for folder in parent.glob(partial_prefix(out) + "*"):
        pid_text = folder.name[len(partial_prefix(out)):].split("-", 1)[0]
        if pid_text.isdigit() and alive(int(pid_text)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
        logger.info("removed %s, left by an export that did not finish", folder)
    return removed


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_error(error: BaseException, folder: Path) -> ToMeExportError:
    """One line for a failed write: the disk-full case named as such."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        return ToMeExportError(f"no space left in {str(folder)!r}: free some space there or write the "
                               "export elsewhere (an fp32 SD 1.5 U-Net takes 3.4 GB)")
    what = (cause.strerror if isinstance(cause, OSError) and cause.strerror
            else f"{type(error).__name__}: {error}")
    return ToMeExportError(f"cannot write to {str(folder)!r}: {str(what).splitlines()[0][:200]}")


def temp_folder(out: Path) -> Path:
    parent = out.parent  # "." for a bare file name
    sweep_stale_partials(out)
    try:  # the pid in the name tells a later export whether this folder's writer is still alive
        return Path(tempfile.mkdtemp(prefix=f"{partial_prefix(out)}{os.getpid()}-", dir=parent))
    except OSError as e:
        raise write_error(e, parent) from e


def remove_temp_folder(out: Path, tmp: Path | None) -> None:
    """Remove this export's temp folder, with SIGTERM / SIGINT held until it is gone. ``tmp=None``
    (a signal arrived between the folder's creation and its path reaching the caller): remove every
    ``.OUT.partial-PID-*`` of this process."""
    parent = out.parent  # "." for a bare file name
    with signals_held():
        for folder in [tmp] if tmp is not None else parent.glob(f"{partial_prefix(out)}{os.getpid()}-*"):
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT wait, pending, until the block ends (main thread, POSIX; elsewhere a no-op):
    a cleanup is not cut short by the signal that caused it."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
