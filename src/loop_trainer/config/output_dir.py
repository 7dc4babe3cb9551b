"""Whether a path can be a run's output directory, checked before anything runs."""

from __future__ import annotations

import os


def output_dir_problem(path: str) -> str | None:
    """Why ``path`` cannot be a run's output directory, in one line (it is a file, lies under a file,
    or cannot be written or created), or None. A directory that does not exist yet is fine as long
    as its nearest existing parent is a writable directory; nothing is created here."""
    target = os.path.abspath(path)
    if os.path.lexists(target) and not os.path.exists(target):
        return f"output_dir {path!r} is a broken symbolic link"
    if os.path.exists(target):
        if not os.path.isdir(target):
            return f"output_dir {path!r} is a file, not a directory (choose a directory path)"
        if not os.access(target, os.W_OK | os.X_OK):
            return f"output_dir {path!r} is not writable (choose a directory you can write to)"
        return None
    parent = os.path.dirname(target)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"output_dir {path!r} cannot be created: {parent!r} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"output_dir {path!r} cannot be created: {parent!r} is not writable"
    return None
