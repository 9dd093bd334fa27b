"""train/data.py: the byte sources, the split, deterministic batches per process."""

from __future__ import annotations

import hashlib
import re

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from train import data as D


@pytest.fixture(scope="module")
def stdlib():
    return D.load_bytes("stdlib")


def test_stdlib_is_deterministic_real_python(stdlib):
    again = D.load_bytes("stdlib")
    assert stdlib.dtype == np.uint8 and stdlib.ndim == 1
    np.testing.assert_array_equal(stdlib, again)
    text = bytes(stdlib)
    assert 2**20 < len(text) <= D.DEFAULT_MAX_BYTES
    assert b"def " in text and b"\n\n# file: os.py\n" in text
    # Files in sorted order, none from the excluded folders.
    names = re.findall(rb"\n\n# file: (\S+)\n", text)
    assert names == sorted(names) and len(names) == len(D.stdlib_files())
    for name in names:
        parts = name.decode().split("/")
        assert not D.STDLIB_EXCLUDED_DIRS.intersection(parts), name
        assert parts[-1].endswith(".py") and parts[-1] not in D.STDLIB_EXCLUDED_FILES
        assert not parts[-1].startswith("_sysconfigdata") and not parts[0].startswith("config-")


def test_stdlib_cap_is_a_prefix(stdlib):
    for cap in (1, 1000, 123_457):
        capped = D.load_bytes("stdlib", max_bytes=cap)
        assert capped.shape == (cap,)
        np.testing.assert_array_equal(capped, stdlib[:cap])


def test_synthetic_is_fixed_small_printable():
    data = D.load_bytes("synthetic")
    assert data.shape == (D.SYNTHETIC_BYTES,) and data.dtype == np.uint8
    np.testing.assert_array_equal(data, D.load_bytes("synthetic"))
    text = bytes(data).decode("ascii")
    assert set(text) <= set("abcdefghijklmnopqrstuvwxyz \n")
    # Every whole line repeats one word 4 to 7 times.
    for line in text.split("\n")[:-1]:
        words = line.split(" ")
        assert 4 <= len(words) <= 7 and len(set(words)) == 1, line
    # Pinned: the synthetic bytes must not change silently (golden training tests use them). If
    # synthetic_bytes changes on purpose, replace the digest with the new one printed here.
    digest = hashlib.sha256(bytes(data)).hexdigest()
    pinned = "66998319b5ff2dba5b2f26671633619f7896d7b712c9b11a0002d5577fb014cd"
    assert digest == pinned, f"synthetic bytes changed: sha256 {digest}"
    np.testing.assert_array_equal(D.load_bytes("synthetic", max_bytes=100), data[:100])


def _write(path, content: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)


def test_folder_sorted_concatenation_skips_hidden_binary_empty(tmp_path):
    _write(tmp_path / "sub" / "c.py", b"print('c')\n")
    _write(tmp_path / "b.txt", "b text \N{GREEK SMALL LETTER ALPHA}\n".encode())
    _write(tmp_path / "a" / "z.md", b"# z\n")
    _write(tmp_path / ".hidden.txt", b"hidden file\n")
    _write(tmp_path / ".git" / "config", b"hidden folder\n")
    _write(tmp_path / "image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    _write(tmp_path / "latin1.txt", "caf\N{LATIN SMALL LETTER E WITH ACUTE}".encode("latin-1"))
    _write(tmp_path / "empty.txt", b"")
    data = D.load_bytes(str(tmp_path))
    expected = (
        b"\n\n# file: a/z.md\n# z\n"
        + b"\n\n# file: b.txt\n"
        + "b text \N{GREEK SMALL LETTER ALPHA}\n".encode()
        + b"\n\n# file: sub/c.py\nprint('c')\n"
    )
    assert bytes(data) == expected
    assert bytes(D.load_bytes(str(tmp_path), max_bytes=30)) == expected[:30]


def test_single_file(tmp_path):
    _write(tmp_path / "t.txt", b"hello world\n")
    assert bytes(D.load_bytes(str(tmp_path / "t.txt"))) == b"hello world\n"
    assert bytes(D.load_bytes(str(tmp_path / "t.txt"), max_bytes=5)) == b"hello"


def test_bad_paths_name_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(D.DataError, match=re.escape(repr(str(missing))) + ".*does not exist"):
        D.load_bytes(str(missing))
    _write(tmp_path / "empty.txt", b"")
    with pytest.raises(D.DataError, match=r"empty\.txt' is empty"):
        D.load_bytes(str(tmp_path / "empty.txt"))
    _write(tmp_path / "blob.bin", b"\x00\x01\x02")
    with pytest.raises(D.DataError, match=r"blob\.bin' is not a UTF-8 text file"):
        D.load_bytes(str(tmp_path / "blob.bin"))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(D.DataError, match=r"nothing' has no non-empty text files"):
        D.load_bytes(str(tmp_path / "nothing"))
    _write(tmp_path / "only_hidden" / ".x.txt", b"x")
    _write(tmp_path / "only_hidden" / "y.bin", b"\x00")
    with pytest.raises(D.DataError, match=r"only_hidden' has no non-empty text files"):
        D.load_bytes(str(tmp_path / "only_hidden"))
    with pytest.raises(ValueError, match=r"max_bytes=0 must be >= 1"):
        D.load_bytes("synthetic", max_bytes=0)
    assert issubclass(D.DataError, ValueError)


def test_split_sizes_views_and_errors():
    data = np.arange(1000, dtype=np.int64).astype(np.uint8)
    train, held = D.split(data, 0.1)
    assert train.shape == (900,) and held.shape == (100,)
    np.testing.assert_array_equal(np.concatenate([train, held]), data)
    train2, held2 = D.split(data, 0.1)
    np.testing.assert_array_equal(train, train2)
    np.testing.assert_array_equal(held, held2)
    assert D.split(data, 0.25, seq_len=100)[1].shape == (250,)
    for bad in (0, 1, 1.0, -0.1, 1.5, True, "0.1", float("nan")):
        with pytest.raises(ValueError, match=r"eval_fraction=.* must be a number in \(0, 1\)"):
            D.split(data, bad)
    with pytest.raises(D.DataError, match=r"1000 bytes .* give 990 train and 10 eval bytes"):
        D.split(data, 0.01, seq_len=32)
    with pytest.raises(D.DataError, match=r"at least 2"):
        D.split(data[:3], 0.5)
    with pytest.raises(ValueError, match=r"data must be uint8 \[n\]"):
        D.split(np.zeros((4, 4), np.uint8), 0.5)


BATCH = dict(batch_size=8, seq_len=16, seed=3)


def test_batch_is_a_pure_function_of_seed_and_step(stdlib):
    data = stdlib[:50_000]
    state = np.random.get_state()
    x0, y0 = D.batch_at(data, 5, **BATCH)
    x1, y1 = D.batch_at(data, 5, **BATCH)
    assert x0.dtype == np.int32 and y0.dtype == np.int32
    assert x0.shape == (8, 16) and y0.shape == (8, 16)
    np.testing.assert_array_equal(x0, x1)
    np.testing.assert_array_equal(y0, y1)
    assert not np.array_equal(x0, D.batch_at(data, 6, **BATCH)[0])
    assert not np.array_equal(x0, D.batch_at(data, 5, **{**BATCH, "seed": 4})[0])
    # The global numpy RNG is neither used nor changed.
    after = np.random.get_state()
    assert state[0] == after[0] and np.array_equal(state[1], after[1])


def test_targets_are_the_next_bytes_of_the_window(stdlib):
    data = stdlib[:50_000]
    x, y = D.batch_at(data, 7, **BATCH)
    offsets = D.window_offsets(data.shape[0], 7, **BATCH)
    for row, o in enumerate(offsets):
        np.testing.assert_array_equal(x[row], data[o : o + 16])
        np.testing.assert_array_equal(y[row], data[o + 1 : o + 17])
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_process_slices_make_the_global_batch(stdlib, process_count):
    data = stdlib[:50_000]
    x, y = D.batch_at(data, 11, **BATCH)
    parts = [
        D.batch_at(data, 11, **BATCH, process_index=p, process_count=process_count)
        for p in range(process_count)
    ]
    assert all(px.shape == (8 // process_count, 16) for px, _ in parts)
    np.testing.assert_array_equal(np.concatenate([px for px, _ in parts]), x)
    np.testing.assert_array_equal(np.concatenate([py for _, py in parts]), y)


def test_batch_errors():
    data = D.load_bytes("synthetic")
    with pytest.raises(ValueError, match=r"batch_size=6 must be divisible by process_count=4"):
        D.batch_at(data, 0, batch_size=6, seq_len=8, seed=0, process_count=4)
    with pytest.raises(ValueError, match=r"process_index=2 must be < process_count=2"):
        D.batch_at(data, 0, batch_size=4, seq_len=8, seed=0, process_index=2, process_count=2)
    with pytest.raises(D.DataError, match=r"10 bytes cannot hold one window of .* 17 bytes"):
        D.batch_at(data[:10], 0, batch_size=4, seq_len=16, seed=0)
    with pytest.raises(ValueError, match=r"step=-1 must be >= 0"):
        D.batch_at(data, -1, batch_size=4, seq_len=8, seed=0)
    with pytest.raises(ValueError, match=r"seed=1.5 must be an int"):
        D.batch_at(data, 0, batch_size=4, seq_len=8, seed=1.5)
    # Exactly one window: every offset is 0.
    x, y = D.batch_at(data[:9], 3, batch_size=2, seq_len=8, seed=0)
    np.testing.assert_array_equal(x, np.stack([data[:8]] * 2))
    np.testing.assert_array_equal(y, np.stack([data[1:9]] * 2))


@settings(max_examples=25)
@given(
    num_bytes=st.integers(2, 300),
    seq_len=st.integers(1, 40),
    batch_size=st.integers(1, 16),
    seed=st.integers(0, 2**32),
    step=st.integers(0, 10**6),
)
def test_offsets_in_range(num_bytes, seq_len, batch_size, seed, step):
    if num_bytes < seq_len + 1:
        with pytest.raises(D.DataError):
            D.window_offsets(num_bytes, step, batch_size=batch_size, seq_len=seq_len, seed=seed)
        return
    offsets = D.window_offsets(num_bytes, step, batch_size=batch_size, seq_len=seq_len, seed=seed)
    assert offsets.shape == (batch_size,)
    assert offsets.min() >= 0 and offsets.max() + seq_len + 1 <= num_bytes


def test_eval_batches_fixed_and_spanning():
    data = D.load_bytes("synthetic")[:5000]
    batches = D.eval_batches(data, batch_size=4, seq_len=32, num_batches=3)
    again = D.eval_batches(data, batch_size=4, seq_len=32, num_batches=3)
    assert len(batches) == 3
    for (x, y), (x2, y2) in zip(batches, again, strict=True):
        assert x.shape == y.shape == (4, 32) and x.dtype == np.int32
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    # The first window starts at the first byte, the last one ends at the last byte.
    np.testing.assert_array_equal(batches[0][0][0], data[:32])
    np.testing.assert_array_equal(batches[-1][1][-1], data[-32:])
    # Per-process rows make up the same batches.
    halves = [
        D.eval_batches(
            data, batch_size=4, seq_len=32, num_batches=3, process_index=p, process_count=2
        )
        for p in range(2)
    ]
    for j, (x, _) in enumerate(batches):
        np.testing.assert_array_equal(np.concatenate([halves[0][j][0], halves[1][j][0]]), x)
    # A single window starts at 0.
    [(x, _)] = D.eval_batches(data, batch_size=1, seq_len=32, num_batches=1)
    np.testing.assert_array_equal(x[0], data[:32])
