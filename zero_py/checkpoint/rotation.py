"""The directories a save may replace or remove: the target it publishes over (nothing, an empty
directory or an earlier checkpoint: not_replaceable) and, with keep_last, the older checkpoints
named like it and the temporary directories their crashed saves left behind (rotate). Only a
directory holding a finished zero_py manifest is ever ours to replace or delete."""

from __future__ import annotations

import os
import re
import shutil
from typing import List, Optional

from zero_py.checkpoint.files import fsync_dir, read_json_file
from zero_py.checkpoint.reader import FORMAT, MANIFEST


NUMBERED = re.compile(r"^(.*?)(\d+)$")
# a save's temporary directory; not its '.old' (publish_dir's fallback without an atomic swap:
# the previous checkpoint, the only copy of it if the save died before the new one took its name)
_LEFT_BEHIND = re.compile(r"^\.(.+)\.tmp-[0-9a-f]{32}$")


def _finished_manifest(path: str) -> Optional[dict]:
    """The manifest of the finished zero_py checkpoint at `path` (a directory, not a link),
    or None where there is none: only such a directory is ever ours to replace or delete."""
    if os.path.islink(path) or not os.path.isdir(path):
        return None
    try:  # a regular file: a FIFO there made the save wait forever, /dev/zero fill memory
        man = read_json_file(os.path.join(path, MANIFEST))
    except (OSError, ValueError):
        return None
    return man if isinstance(man, dict) and man.get("format") == FORMAT else None


def not_replaceable(path: str) -> Optional[str]:
    """Why a save may not publish at `path`, or None. Publishing swaps out whatever is there
    and deletes it, so it goes only where nothing is, over an empty directory or over an
    earlier checkpoint: a file, a link or a directory of other things is the user's."""
    if not os.path.lexists(path) or _finished_manifest(path) is not None:
        return None
    if os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path):
        return None
    what = ("a symbolic link" if os.path.islink(path) else
            "a directory that is not a zero_py checkpoint" if os.path.isdir(path) else
            "a file")
    return (f"{path} exists and is {what}; a save replaces the path whole (deleting what is "
            "there), so it writes only where nothing is, into an empty directory or over an "
            "earlier checkpoint: remove it or save elsewhere")


def rotate(path: str, keep_last: int) -> List[str]:
    """After a save to `path`: removes the checkpoints named like it (same name, another number)
    beyond the keep_last newest (by step, then number), never `path` itself (a run restarted
    from scratch saves smaller steps under new names: the checkpoint just written is kept, and
    the keep_last - 1 newest others), and never a directory without a finished zero_py manifest
    (or whose step is not a number). Also removes the temporary directories that saves of the
    other checkpoints named like it left behind (their rank 0 died mid-save). Returns what
    could not be removed: '<path> (<why>)'."""
    parent, base = os.path.split(path)
    stem = NUMBERED.match(base).group(1)
    found = []
    try:
        names = os.listdir(parent)
    except OSError as exc:
        return [f"{parent} ({exc.strerror or exc}: its checkpoints could not be listed)"]
    for name in names:
        m = NUMBERED.match(name)
        full = os.path.join(parent, name)
        left = _LEFT_BEHIND.match(name)
        if left is not None:
            # what a save of another checkpoint of this run left when its rank 0 died (killed,
            # or SIGTERM from torchrun): only a save of that same name used to remove it
            other = NUMBERED.match(left.group(1))
            if other is not None and other.group(1) == stem and left.group(1) != base:
                shutil.rmtree(full, ignore_errors=True)
            continue
        if not m or m.group(1) != stem or full == path:
            continue
        man = _finished_manifest(full)  # None: not a finished zero_py checkpoint, not ours
        step = man.get("step") if man is not None else None
        if isinstance(step, int) and not isinstance(step, bool):
            found.append((step, int(m.group(2)), full))
    found.sort()
    failed = []
    for _, _, full in found[:max(0, len(found) - (keep_last - 1))]:
        try:
            _remove_checkpoint(full)
        except OSError as exc:
            failed.append(f"{full} ({exc.strerror or exc}"
                          + (f": {exc.filename}" if exc.filename not in (None, full) else "")
                          + ")")
    if len(failed) < len(found):
        try:
            fsync_dir(parent)
        except OSError:
            pass  # the removals stand; only their durability is unsure
    return failed


def _remove_checkpoint(full: str) -> None:
    """Removes an old checkpoint directory, its manifest last: one that cannot be removed whole
    stays a finished checkpoint (which a load refuses for its missing files) that the next
    rotation tries again, never a directory of files no rotation takes."""
    names = sorted(os.listdir(full), key=lambda n: (n == MANIFEST, n))
    for name in names:
        entry = os.path.join(full, name)
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry)
        else:
            os.unlink(entry)
    os.rmdir(full)
