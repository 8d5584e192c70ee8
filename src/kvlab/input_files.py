"""Reading the files a user names, with one clear error that names the file and what it should be.

A path typed on the command line can be a folder, empty, binary or unreadable, and the OS and codec
say so without naming the file or what it should hold ("'utf-8' codec can't decode byte 0x89").
Every reader of a user's file goes through `read_text`, so each failure is one `InputFileError`,
`<path>: <what is wrong>; expected <what it should hold>`, which `kvlab` prints before exit 2.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["InputFileError", "MissingInputFileError", "read_text", "input_file_error",
           "MAX_TEXT_BYTES"]

# The largest text file the course reads whole. The traces are about 1 MB; a file of gigabytes is a
# wrong path (a model's weights, a disk image), and reading it would only exhaust memory.
MAX_TEXT_BYTES = 2**30


class InputFileError(ValueError):
    """A file or folder the user named that cannot be used. The message starts with its path."""


class MissingInputFileError(InputFileError, FileNotFoundError):
    """The named file or folder does not exist (also a FileNotFoundError, for callers that ask)."""


def input_file_error(path: str | Path, problem: str, expected: str) -> InputFileError:
    """The error for `path`: '<path>: <problem>; expected <expected>'."""
    return InputFileError(f"{path}: {problem}; expected {expected}")


def read_text(path: str | Path, expected: str) -> str:
    """The file as UTF-8 (BOM dropped); `expected` is for the message. MissingInputFileError;
    InputFileError: a folder, over MAX_TEXT_BYTES, unreadable, blank, binary (NUL) or not UTF-8."""
    path = Path(path)
    if not path.exists():
        raise MissingInputFileError(f"{path}: no such file; expected {expected}")
    if path.is_dir():
        raise input_file_error(path, "is a folder, not a file", expected)
    size = path.stat().st_size
    if size > MAX_TEXT_BYTES:
        raise input_file_error(path, f"is {size:,} B, too large for a text file the course reads "
                                     f"(at most {MAX_TEXT_BYTES:,} B)", expected)
    try:
        data = path.read_bytes()
    except PermissionError:
        raise input_file_error(path, "cannot be read (permission denied)", expected) from None
    except OSError as error:
        raise input_file_error(path, f"cannot be read ({error.strerror or error})",
                               expected) from None
    if not data.strip():
        raise input_file_error(path, "is empty", expected)
    if b"\x00" in data:
        # Text formats never contain NUL bytes; binary ones (safetensors, zip, images) nearly always do.
        raise input_file_error(path, "is a binary file, not text", expected)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise input_file_error(path, f"is not UTF-8 text (byte 0x{data[error.start]:02x} at "
                                     f"offset {error.start})", expected) from None
