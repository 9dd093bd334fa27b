"""Byte-level training data: where the bytes come from, the held-out split, deterministic batches.

Tokens are bytes: int32 ids 0..255 (`VOCAB_SIZE`). Three sources, no download:

  "stdlib"     the `.py` files of the Python standard library installed with the running
               interpreter, in sorted order (real text that every machine has).
  "synthetic"  a small deterministic task for tests: short words repeated along a line.
  a path       a text file, or a folder whose text files are joined in sorted order.

Batches are a pure function of (data, seed, step): `batch_at` draws the window offsets of global
batch `step` from a numpy Generator seeded with (seed, step), and process p keeps rows
[p*b, (p+1)*b) of it. A resumed run therefore needs no data state, and the union of the processes'
rows is the same global batch for every process count.

Shape vocabulary: B the global batch (`batch_size`), b = B // process_count the rows of this
process, L the sequence length (`seq_len`), n the bytes of the data.
"""

from __future__ import annotations

import numbers
import os
import pathlib
import sysconfig
import typing

import numpy as np

from mok_jax.config import check_int

VOCAB_SIZE = 256

# The default cap of `load_bytes`: 32 MiB bounds memory and start-up time; "stdlib" is 9.4 MiB
# (512 files, CPython 3.12.1, read in 0.04-0.08 s from a warm page cache), so the cap does not bind.
DEFAULT_MAX_BYTES = 32 * 2**20

# Size of the "synthetic" task: 128 KiB, enough for a train/eval split of tiny batches.
SYNTHETIC_BYTES = 128 * 2**10

# Standard-library folders left out of "stdlib", matched against every component of a file's
# path relative to the standard-library folder:
#   site-packages, dist-packages: third-party code that differs from machine to machine;
#   test, tests, idle_test: the test suites (about 19 MiB in CPython 3.12, more than the library
#     itself), which Debian/Ubuntu ship as a separate package and the official slim Docker images
#     delete, and which include deliberately malformed files (bad syntax, bad encodings);
#   idlelib, tkinter, turtledemo, lib2to3, ensurepip: modules that Linux distributions commonly
#     split into optional packages.
# What remains is the part of the library every installation of the same Python version has, so
# "stdlib" gives the same bytes on every machine with that version (to the patch release; a
# distribution that patches library files, as Debian does sysconfig.py, changes those files).
STDLIB_EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "lib2to3",
        "ensurepip",
        "__pycache__",
    }
)
# Single files distributions ship with the optional packages above (turtle.py needs tkinter).
STDLIB_EXCLUDED_FILES = frozenset({"turtle.py"})
# Files and folders that a build writes for itself (compiler flags, install prefix): the build
# configuration `_sysconfigdata_<abi>_<platform>.py` and `config-<version>-<platform>/`.
_STDLIB_BUILD_FILE_PREFIX = "_sysconfigdata"
_STDLIB_BUILD_DIR_PREFIX = "config-"

# Leading bytes searched for a NUL byte, the sign of a binary file (see `_is_text`).
_SNIFF_BYTES = 8192


class DataError(ValueError):
    """Bad training data: a missing or empty path, no readable text, too little data."""


def _header(relative: str) -> bytes:
    """The separator written before each file: a blank line and a comment naming the file."""
    return f"\n\n# file: {relative}\n".encode()


def _join(
    files: list[tuple[str, pathlib.Path]], max_bytes: int, *, text_only: bool = False
) -> np.ndarray:
    """Each file's header and bytes, in the given order, up to `max_bytes` bytes (a prefix).

    Files past the cap are not read. With `text_only`, files that are not text (`_is_text`) and
    empty files are skipped.
    """
    chunks: list[bytes] = []
    total = 0
    for relative, path in files:
        if total >= max_bytes:
            break
        raw = path.read_bytes()
        if text_only and not (raw and _is_text(raw)):
            continue
        piece = _header(relative) + raw
        chunks.append(piece)
        total += len(piece)
    joined = b"".join(chunks)[:max_bytes]
    # Read-only view of the bytes: the data never changes after loading.
    return np.frombuffer(joined, dtype=np.uint8)


def stdlib_files() -> list[tuple[str, pathlib.Path]]:
    """The standard-library files "stdlib" reads: (relative POSIX path, path), sorted by the first.

    The folder is `sysconfig.get_paths()["stdlib"]` of the running interpreter; `.py` files only,
    without the folders in `STDLIB_EXCLUDED_DIRS`, the files in `STDLIB_EXCLUDED_FILES`, and the
    build's own configuration (`_sysconfigdata_*.py`, `config-*/`), which differs per build.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"the standard library folder {str(root)!r} does not exist")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d
            for d in dirnames
            if d not in STDLIB_EXCLUDED_DIRS and not d.startswith(_STDLIB_BUILD_DIR_PREFIX)
        ]
        for name in filenames:
            if (
                name.endswith(".py")
                and name not in STDLIB_EXCLUDED_FILES
                and not name.startswith(_STDLIB_BUILD_FILE_PREFIX)
            ):
                path = pathlib.Path(dirpath, name)
                files.append((path.relative_to(root).as_posix(), path))
    files.sort(key=lambda item: item[0])
    if not files:
        raise DataError(f"no .py files found in the standard library folder {str(root)!r}")
    return files


def _splitmix64(state: int) -> tuple[int, int]:
    """One step of SplitMix64: (new state, 64-bit output). Pure Python, so the synthetic bytes
    never depend on numpy's generator streams."""
    mask = (1 << 64) - 1
    state = (state + 0x9E3779B97F4A7C15) & mask
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return state, z ^ (z >> 31)


def synthetic_bytes(num_bytes: int = SYNTHETIC_BYTES) -> np.ndarray:
    """The "synthetic" task: lines made of one short word repeated, e.g. b"qet qet qet qet\\n".

    A vocabulary of 32 words (3 to 6 lowercase letters) is drawn once from a fixed seed; each line
    repeats one word, drawn from the same fixed stream, 4 to 7 times (30 bytes a line on average).
    Only a line's first letters and its length are uncertain; the rest follows from the line so
    far. Measured on the 128 KiB (plug-in estimates): 3.16 nats/byte for byte frequencies alone,
    1.84 given the previous byte, 0.47 given two, 0.21 given three: a model learns most of it
    from short contexts, well below the 5.55 nats (log 256) of a fresh model.

    Returns:
      uint8 [num_bytes], the same bytes on every machine (pure-Python SplitMix64, seed 0).
    """
    num_bytes = check_int("num_bytes", num_bytes, minimum=1)
    state = 0

    def draw(n: int) -> int:
        nonlocal state
        state, value = _splitmix64(state)
        return value % n

    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(letters[draw(26)] for _ in range(3 + draw(4))) for _ in range(32)]
    out = bytearray()
    while len(out) < num_bytes:
        word = words[draw(len(words))]
        out += (" ".join([word] * (4 + draw(4))) + "\n").encode()
    return np.frombuffer(bytes(out[:num_bytes]), dtype=np.uint8)


def _is_text(raw: bytes) -> bool:
    """Whether a file's bytes are text: no NUL byte in the first 8 KiB, and valid UTF-8.

    The NUL test is git's heuristic for binary files (it catches images, archives, compiled
    files); the UTF-8 test rejects what the NUL test misses, such as compressed data without NUL
    bytes near the start. Text in legacy 8-bit encodings (Latin-1, ...) is therefore skipped too.
    """
    if b"\0" in raw[:_SNIFF_BYTES]:
        return False
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _folder_files(root: pathlib.Path) -> list[tuple[str, pathlib.Path]]:
    """The non-hidden files under `root`, recursively, sorted by relative POSIX path.

    Hidden entries (a name starting with ".") are skipped, folders included; links to folders are
    not followed (a link cycle cannot hang the walk). Binary files are skipped later, when read.
    """
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = pathlib.Path(dirpath, name)
            if not name.startswith(".") and path.is_file():
                files.append((path.relative_to(root).as_posix(), path))
    files.sort(key=lambda item: item[0])
    return files


def load_bytes(source: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """The training bytes of a source: "stdlib", "synthetic" or a path to a text file or folder.

    Files are joined in sorted order of their relative POSIX paths, each preceded by a separator
    line naming it (b"\\n\\n# file: <relative path>\\n"), and the result is cut to its first
    `max_bytes` bytes; files past the cap are not read.

    Args:
      source: "stdlib": the standard library's `.py` files (see `stdlib_files`); "synthetic": see
        `synthetic_bytes`; anything else is a path. A file must be text (`_is_text`); a folder
        contributes its non-hidden text files, recursively, binary files skipped.
      max_bytes: the cap, in bytes (>= 1).

    Returns:
      uint8 [n], read-only, n <= max_bytes.

    Raises:
      DataError: the path does not exist, is empty, is a binary file, or a folder without text.

    Example:
      >>> data = load_bytes("synthetic")
      >>> data.dtype, bytes(data[:4]).isascii()
      (dtype('uint8'), True)
    """
    max_bytes = check_int("max_bytes", max_bytes, minimum=1)
    if source == "stdlib":
        return _join(stdlib_files(), max_bytes)
    if source == "synthetic":
        return synthetic_bytes(min(SYNTHETIC_BYTES, max_bytes))
    path = pathlib.Path(source).expanduser()
    if not path.exists():
        raise DataError(f"data path {source!r} does not exist (or use 'stdlib' or 'synthetic')")
    if path.is_file():
        raw = path.read_bytes()
        if not raw:
            raise DataError(f"data file {source!r} is empty")
        if not _is_text(raw):
            raise DataError(f"data file {source!r} is not a UTF-8 text file")
        return np.frombuffer(raw[:max_bytes], dtype=np.uint8)
    if path.is_dir():
        data = _join(_folder_files(path), max_bytes, text_only=True)
        if data.shape[0] == 0:
            raise DataError(
                f"data folder {source!r} has no non-empty text files (hidden entries and binary "
                "files are skipped)"
            )
        return data
    raise DataError(f"data path {source!r} is neither a file nor a folder")


def _as_data(data: typing.Any) -> np.ndarray:
    data = np.asarray(data)
    if data.ndim != 1 or data.dtype != np.uint8:
        raise ValueError(f"data must be uint8 [n], got {data.dtype} {list(data.shape)}")
    return data


def split(
    data: np.ndarray, eval_fraction: float, *, seq_len: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The train and eval parts of the data: the last `eval_fraction` of the bytes is held out.

    Args:
      data: uint8 [n].
      eval_fraction: in (0, 1); the eval part has round(n * eval_fraction) bytes.
      seq_len: if given, both parts must hold one window of L + 1 bytes (inputs and targets);
        otherwise two bytes (one input, one target).

    Returns:
      (train uint8 [n - m], eval uint8 [m]), views of `data`.

    Raises:
      DataError: a part is too short for one window (the message gives the sizes).
    """
    data = _as_data(data)
    if (
        isinstance(eval_fraction, bool)
        or not isinstance(eval_fraction, numbers.Real)
        or not 0.0 < eval_fraction < 1.0
    ):
        raise ValueError(f"{eval_fraction=} must be a number in (0, 1)")
    window = 2 if seq_len is None else check_int("seq_len", seq_len, minimum=1) + 1
    n = data.shape[0]
    num_eval = round(n * float(eval_fraction))
    num_train = n - num_eval
    if min(num_train, num_eval) < window:
        raise DataError(
            f"{n} bytes with {eval_fraction=} give {num_train} train and {num_eval} eval bytes; "
            f"each part needs at least {window} (seq_len + 1): use more data or another fraction"
        )
    return data[:num_train], data[num_train:]


def _check_batch(
    data: np.ndarray, *, batch_size: int, seq_len: int, process_index: int, process_count: int
) -> int:
    """Validates the batch arguments; returns b, the rows of one process."""
    batch_size = check_int("batch_size", batch_size, minimum=1)
    seq_len = check_int("seq_len", seq_len, minimum=1)
    process_count = check_int("process_count", process_count, minimum=1)
    process_index = check_int("process_index", process_index, minimum=0)
    if process_index >= process_count:
        raise ValueError(f"{process_index=} must be < {process_count=}")
    if batch_size % process_count:
        raise ValueError(f"{batch_size=} must be divisible by {process_count=}")
    if data.shape[0] < seq_len + 1:
        raise DataError(
            f"{data.shape[0]} bytes cannot hold one window of seq_len + 1 = {seq_len + 1} bytes"
        )
    return batch_size // process_count


def window_offsets(
    num_bytes: int, step: int, *, batch_size: int, seq_len: int, seed: int
) -> np.ndarray:
    """The start offsets of global batch `step`: int64 [B], each in [0, n - L - 1].

    Drawn with `np.random.default_rng((seed, step))`, so a pure function of its arguments.
    """
    num_bytes = check_int("num_bytes", num_bytes, minimum=2)
    step = check_int("step", step, minimum=0)
    seed = check_int("seed", seed, minimum=0)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    seq_len = check_int("seq_len", seq_len, minimum=1)
    if num_bytes < seq_len + 1:
        raise DataError(f"{num_bytes} bytes cannot hold one window of {seq_len + 1} bytes")
    rng = np.random.default_rng((seed, step))
    return rng.integers(0, num_bytes - seq_len, size=batch_size, dtype=np.int64)


def _windows(data: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = data[offsets[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def batch_at(
    data: np.ndarray,
    step: int,
    *,
    batch_size: int,
    seq_len: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """This process's rows of global training batch `step`: random windows of the data.

    Args:
      data: uint8 [n], the train split.
      step: the batch index (>= 0).
      batch_size: B, the global batch, divisible by `process_count`.
      seq_len: L.
      seed: the data seed (>= 0); with `step` it seeds the window offsets (`window_offsets`).
      process_index, process_count: this process takes rows [p*b, (p+1)*b), b = B // count.

    Returns:
      (inputs, targets), int32 [b, L] each; targets[:, i] = inputs[:, i + 1] for i < L - 1, and
      each row is data[o : o + L] and data[o + 1 : o + L + 1] for its offset o.

    Example:
      >>> x, y = batch_at(load_bytes("synthetic"), 0, batch_size=4, seq_len=16, seed=0)
      >>> x.shape, y.dtype
      ((4, 16), dtype('int32'))
    """
    data = _as_data(data)
    rows = _check_batch(
        data,
        batch_size=batch_size,
        seq_len=seq_len,
        process_index=process_index,
        process_count=process_count,
    )
    offsets = window_offsets(data.shape[0], step, batch_size=batch_size, seq_len=seq_len, seed=seed)
    return _windows(data, offsets[process_index * rows : (process_index + 1) * rows], seq_len)


def eval_batches(
    data: np.ndarray,
    *,
    batch_size: int,
    seq_len: int,
    num_batches: int,
    process_index: int = 0,
    process_count: int = 1,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Fixed evaluation batches: num_batches * B windows evenly spaced over the data.

    Window i of W = num_batches * B starts at floor(i * (n - L - 1) / (W - 1)) (0 when W = 1), so
    the windows cover the eval split from its first to its last byte and overlap only when it is
    short. Batch j holds windows [j*B, (j+1)*B); process p takes rows [p*b, (p+1)*b) of each.

    Returns:
      num_batches pairs (inputs, targets), int32 [b, L] each, as in `batch_at`.
    """
    data = _as_data(data)
    rows = _check_batch(
        data,
        batch_size=batch_size,
        seq_len=seq_len,
        process_index=process_index,
        process_count=process_count,
    )
    num_batches = check_int("num_batches", num_batches, minimum=1)
    num_windows = num_batches * batch_size
    last_start = data.shape[0] - seq_len - 1
    offsets = np.arange(num_windows, dtype=np.int64) * last_start // max(num_windows - 1, 1)
    offsets = offsets.reshape(num_batches, batch_size)
    return [
        _windows(data, row[process_index * rows : (process_index + 1) * rows], seq_len)
        for row in offsets
    ]
