"""Files replaced whole: written beside their place, then renamed over it.

Written in place, a write that failed part way (a full disk, a plot that raised) had
already truncated the file a run or a user had there, and a reader (a viewer refreshing a
live run's plot, another process loading a cache) could see half a file.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from typing import Callable, Mapping


def replace_all_or_none(writers: Mapping[str | os.PathLike, Callable[[str], None]], *,
                        sync: bool = False) -> None:
    """Calls each `writers[path](staged)`, then renames every staged file over its path.

    A staged file sits in a fresh hidden folder inside its path's folder (one file
    system, so the rename is atomic) and has its path's own name: matplotlib's savefig
    reads the format from the extension, and what a writer was given reads like the file
    it makes. The renames start only once every writer has returned, so a failing writer
    leaves all the earlier files as they were; the staging folders are removed either way.

    Args:
      writers: final path -> a function that writes the whole file at the path it is given.
        A path that is a symlink is replaced where it points, as `open(path, "w")` would;
        of two paths naming one file, the later one's writer writes it.
      sync: fsync each staged file before the renames, for files whose loss on a power
        cut would cost more than the write (a cache that is otherwise moved aside as corrupt).
    """
    # Keyed by the real path: two names of one file (--json DIR/x.json beside --out DIR)
    # write it once, the later writer's, as two plain writes in turn would have left it.
    by_file = {os.path.realpath(path): write for path, write in writers.items()}
    folders = [path for path in writers if os.path.isdir(path)]
    if folders:  # os.replace's error named the hidden staging file, after every writer ran
        raise IsADirectoryError(errno.EISDIR, "is a folder, where a file is to be written "
                                "(move or rename it)", os.fspath(folders[0]))
    staging_dirs: dict[str, str] = {}  # folder -> its staging folder
    try:
        staged = []
        for final, write in by_file.items():
            folder, name = os.path.split(final)
            if folder not in staging_dirs:
                staging_dirs[folder] = tempfile.mkdtemp(prefix=f".{name}.partial-", dir=folder)
            temp = os.path.join(staging_dirs[folder], name)
            write(temp)
            if sync:
                with open(temp, "rb") as file:
                    os.fsync(file.fileno())
            staged.append((temp, final))
        for temp, final in staged:
            os.replace(temp, final)
    finally:
        for staging in staging_dirs.values():  # a failed clean-up must not hide the error
            shutil.rmtree(staging, ignore_errors=True)


def replace_file(path: str | os.PathLike, write: Callable[[str], None], *, sync: bool = False) -> None:
    """`replace_all_or_none` for one file."""
    replace_all_or_none({path: write}, sync=sync)


def replace_text(path: str | os.PathLike, text: str, *, sync: bool = False) -> None:
    """Replaces the file at `path` with `text` (UTF-8), whole or not at all."""

    def write(temp: str) -> None:
        with open(temp, "w", encoding="utf-8") as file:
            file.write(text)

    replace_file(path, write, sync=sync)

