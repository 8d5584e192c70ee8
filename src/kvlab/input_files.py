"""Reading the files a user names, with one clear error that names the file and what it should be.

A trace, a config.json or a checkpoint folder typed on the command line can turn out to be a
folder, an empty file, a binary file or a file without read permission. The operating system and the
text codec report those with messages that do not say which file was meant or what it should have
held ("'utf-8' codec can't decode byte 0x89 in position 0"). Every reader of a user's file goes
through `read_text` instead, so every such failure becomes one `InputFileError` of the form

    <path>: <what is wrong>; expected <what the file should hold>

which the `kvlab` command prints on one line before exiting with status 2.
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
    """The whole text of a user's file, decoded as UTF-8 (a leading byte-order mark is dropped).

    Args:
        path: the file as the user gave it.
        expected: what the file should hold, for the message (e.g. "a CSV trace with header
            TIMESTAMP,ContextTokens,GeneratedTokens").

    Returns:
        The text (str). Files are read whole: the largest the course reads is a trace of ~1 MB.

    Raises:
        MissingInputFileError: no such file.
        InputFileError: a folder, a file over MAX_TEXT_BYTES, an unreadable file (permissions,
            I/O error), an empty or whitespace-only file, a binary file (it holds NUL bytes), or
            text that is not UTF-8. The message names the path and `expected`.
    """
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
