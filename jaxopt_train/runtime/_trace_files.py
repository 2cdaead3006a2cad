"""Finding the newest profiler output file below a folder, without walking a whole disk.

`jax.profiler` writes `<logdir>/plugins/profile/<time>/<host>.<kind>`: three folders below
the log folder, four below a run folder that holds it. A recursive glob from the folder the
user named went everywhere below it, so `jaxopt-train kernels /` read the whole file system
before answering. The walk here goes a bounded number of folders deep and stops with a clear
error after a bounded number of folders.
"""

from __future__ import annotations

import os

# Folders below the one named: plugins/profile/<time>/ is 3; a run folder, a sweep of runs,
# or a log folder one level up from them stays within 6.
MAX_DEPTH = 6
# Folders read before giving up: a sweep of a few hundred runs is ~5 folders per run.
MAX_FOLDERS = 20_000


def newest_file_below(folder: str, suffix: str, *, max_depth: int | None = None,
                      max_folders: int | None = None) -> str:
    """The most recently modified regular file named `*<suffix>` at most `max_depth` folders
    below `folder`.

    Raises:
      FileNotFoundError: no such file within that depth.
      ValueError: more than `max_folders` folders below `folder` (a disk root, a home
        folder): the search stops instead of reading them all.
    """
    max_depth = MAX_DEPTH if max_depth is None else max_depth
    max_folders = MAX_FOLDERS if max_folders is None else max_folders
    base_depth = folder.rstrip(os.sep).count(os.sep)
    found, seen = [], 0
    for path, dirnames, filenames in os.walk(folder):
        seen += 1
        if seen > max_folders:
            raise ValueError(
                f"more than {max_folders:,} folders under {folder!r} and no end in sight; "
                f"expected a jax.profiler log folder (it writes plugins/profile/<time>/<host>"
                f"{suffix}) or the {suffix} file itself: name that")
        if path.rstrip(os.sep).count(os.sep) - base_depth >= max_depth:
            dirnames[:] = []  # files here still count; nothing deeper is read
        # isfile: a broken symlink (or a folder) of that name failed getmtime below with a
        # bare FileNotFoundError, though a readable trace sat beside it.
        found += [p for p in (os.path.join(path, name) for name in filenames if name.endswith(suffix))
                  if os.path.isfile(p)]
    if not found:
        raise FileNotFoundError(
            f"no *{suffix} under {folder!r} (looked {max_depth} folders deep; a jax.profiler "
            f"trace writes one under plugins/profile/<time>/)")
    return max(found, key=os.path.getmtime)
