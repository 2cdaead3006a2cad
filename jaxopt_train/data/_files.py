"""The one check of a data file's path that every loader makes before opening it."""

from __future__ import annotations

import os
import pathlib


def regular_file(path: str | os.PathLike, what: str, expected: str, *,
                 folder_expected: str | None = None) -> pathlib.Path:
    """`path` as a Path, once it names an existing regular file.

    `what` names the file in messages ("token file"); `expected` says what should be there,
    `folder_expected` (default `expected`) what should be there when `path` is a folder.

    Raises:
      FileNotFoundError: nothing at `path`.
      ValueError: a folder, or something else that is not a regular file (a pipe, a device).
    """
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"{what} path={str(path)!r} is a folder, not a file; "
                         f"expected {folder_expected or expected}")
    if not path.exists():
        raise FileNotFoundError(f"{what} path={str(path)!r} does not exist")
    if not path.is_file():  # "does not exist" would be false of a FIFO or device
        raise ValueError(f"{what} path={str(path)!r} is not a regular file (a pipe or device?); "
                         f"expected {expected}")
    return path
