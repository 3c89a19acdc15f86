"""Contract tests for the EC connector, run against both backends (filesystem, real Redis)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import torch

from connectors.ec import (
    ECCorruptEntryError,
    ECStore,
    ECTimeoutError,
    FilesystemECStore,
    RedisECStore,
    decode_entry,
    encode_entry,
    open_ec_store,
)
from connectors.ec.codec import MAGIC

REPO_ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


@dataclass(frozen=True)
class Backend:
    name: str
    url: str
    kw: dict = field(default_factory=dict)

    def open(self, **extra) -> ECStore:
        return open_ec_store(self.url, **{**self.kw, **extra})

    def raw_write(self, key: str, data: bytes) -> None:
        """Write bytes straight into the backend's storage, bypassing the store."""
        if self.name == "fs":
            path = FilesystemECStore(self.url, max_bytes=1).path_for(key)
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(data)
        else:
            with redis.Redis.from_url(self.url) as r, RedisECStore(self.url, **self.kw) as s:
                r.set(s.data_key(key), data)

    def cleanup(self) -> None:
        if self.name == "redis":
            with redis.Redis.from_url(self.url) as r:
                for k in r.scan_iter(match=self.kw["prefix"] + "*", count=1000):
                    r.delete(k)


@pytest.fixture(params=["fs", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "fs":
        b = Backend("fs", str(tmp_path / "ec"), {"max_bytes": 1 << 30})
    else:
        b = Backend("redis", request.getfixturevalue("redis_url"), {"prefix": f"t:{uuid.uuid4().hex}:"})
    yield b
    b.cleanup()


@pytest.fixture
def store(backend: Backend):
    s = backend.open()
    yield s
    s.close()


def _randn(rows: int, width: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g).to(dtype)


def _key(tag: str = "k") -> str:
    return f"{tag}{uuid.uuid4().hex}"


# -- 1. round trip -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_bit_exact(store: ECStore, dtype: torch.dtype) -> None:
    src = _randn(37, 96, dtype)
    src[0, :4] = torch.tensor([float("inf"), -0.0, float("nan"), 1e-8]).to(dtype)
    meta = {"grid_thw": "1,8,6", "model": "tiny-vl"}
    key = _key()
    assert store.put(key, src, meta) is True
    entry = store.get(key)
    assert entry is not None
    assert entry.dtype == dtype and (entry.rows, entry.width) == (37, 96)
    # Bit-exact, NaN included: compare raw bytes, then values.
    assert torch.equal(entry.tensor.view(torch.uint8), src.view(torch.uint8))
    assert torch.equal(entry.tensor[1:], src[1:])
    assert entry.meta == meta
    assert store.exists(key)


def test_put_existing_key_is_noop(store: ECStore) -> None:
    key = _key()
    src = _randn(4, 8)
    assert store.put(key, src, {"v": "1"}) is True
    assert store.put(key, src, {"v": "2"}) is False
    assert store.get(key).meta == {"v": "1"}  # first writer wins
    assert store.stats().entries == 1


def test_delete(store: ECStore) -> None:
    key = _key()
    store.put(key, _randn(4, 8))
    assert store.delete(key) is True
    assert store.delete(key) is False
    assert not store.exists(key) and store.get(key) is None
    assert store.stats() == type(store.stats())(bytes_used=0, entries=0)


# -- 3. readers never see partial entries --------------------------------------


def test_reader_never_sees_partial_entry(backend: Backend, store: ECStore) -> None:
    key = _key("big")
    src = _randn(2048, 4096)  # 32 MiB
    writer_store = backend.open()
    done = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for _ in range(4):  # each round opens a window a torn write would show in
                writer_store.put(key, src)
                writer_store.delete(key)
            writer_store.put(key, src)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=write)
    t.start()
    polls = 0
    try:
        while not done.is_set():
            entry = store.get(key)  # a torn entry would raise ECCorruptEntryError
            polls += 1
            if entry is not None:
                assert torch.equal(entry.tensor, src)
    finally:
        t.join()
        writer_store.close()
    assert not errors, errors
    assert polls > 0
    assert torch.equal(store.get(key).tensor, src)


# -- 4. missing keys -----------------------------------------------------------


def test_missing_key(store: ECStore) -> None:
    key = _key("missing")
    assert store.get(key) is None
    assert not store.exists(key)
    t0 = time.monotonic()
    with pytest.raises(ECTimeoutError) as exc:
        store.wait(key, 0.3)
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 1.0
    assert key in str(exc.value) and "0.3" in str(exc.value)
    assert isinstance(exc.value, TimeoutError)


def test_wait_sees_late_put(backend: Backend, store: ECStore) -> None:
    key = _key("late")
    src = _randn(8, 16)
    producer = backend.open()
    timer = threading.Timer(0.1, producer.put, args=(key, src))
    timer.start()
    try:
        entry = store.wait(key, 5.0)
    finally:
        timer.join()
        producer.close()
    assert torch.equal(entry.tensor, src)


# -- 5. eviction ---------------------------------------------------------------


def test_eviction_keeps_budget_lru(backend: Backend) -> None:
    def tensor(i: int) -> torch.Tensor:
        return torch.full((16, 64), float(i))

    entry_size = len(encode_entry(tensor(0), {"i": "0"}))
    max_bytes = 4 * entry_size + entry_size // 2
    keys = [f"evict{i:02d}" for i in range(6)]
    with backend.open(max_bytes=max_bytes) as s:
        for i, k in enumerate(keys[:4]):
            assert s.put(k, tensor(i), {"i": str(i)})
        assert s.stats().entries == 4
        assert torch.equal(s.get(keys[0]).tensor, tensor(0))  # keys[0] is now most recent
        s.put(keys[4], tensor(4), {"i": "4"})
        s.put(keys[5], tensor(5), {"i": "5"})
        st = s.stats()
        assert st.bytes_used <= max_bytes and st.entries == 4
        assert st.bytes_used == 4 * entry_size
        assert not s.exists(keys[1]) and not s.exists(keys[2])
        assert all(s.exists(k) for k in (keys[0], keys[3], keys[4], keys[5]))
        assert torch.equal(s.get(keys[0]).tensor, tensor(0))
        for i in range(10, 20):  # budget holds under churn
            s.put(f"churn{i}", tensor(i % 10), {"i": str(i % 10)})
            assert s.stats().bytes_used <= max_bytes


def test_entry_over_budget_rejected(backend: Backend) -> None:
    with backend.open(max_bytes=1 * MiB) as s:
        with pytest.raises(ValueError, match="bytes"):
            s.put(_key(), torch.zeros(1, 1024).expand(1024, 1024))  # 4 MiB, never materialized
        assert s.stats().entries == 0


def test_redis_rejects_over_512mib(redis_url: str) -> None:
    huge = torch.zeros(1, 1024).expand(131073, 1024)  # 512 MiB + 4 KiB, never materialized
    with RedisECStore(redis_url, prefix=f"t:{uuid.uuid4().hex}:") as s:
        with pytest.raises(ValueError, match="limit"):
            s.put(_key(), huge)


# -- 6. damaged entries --------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_entry_is_rejected_and_removed(backend: Backend, store: ECStore, damage: str) -> None:
    key = _key("dmg")
    src = _randn(64, 32)
    good = encode_entry(src, {"m": "x"})
    assert store.put(key, src, {"m": "x"})
    if damage == "truncate":
        bad = good[: len(good) - 100]
    else:
        i = len(good) - 50  # inside the payload
        bad = good[:i] + bytes([good[i] ^ 0x01]) + good[i + 1 :]
    backend.raw_write(key, bad)
    with pytest.raises(ECCorruptEntryError, match=key):
        store.get(key)
    assert not store.exists(key)
    assert store.get(key) is None
    assert store.stats() == type(store.stats())(bytes_used=0, entries=0)
    assert store.put(key, src, {"m": "x"}) is True  # can be re-published
    assert torch.equal(store.get(key).tensor, src)
    assert store.stats().bytes_used == len(good)


# -- 7. TTL and large entries --------------------------------------------------


def test_redis_ttl_expiry_and_refresh(redis_url: str) -> None:
    prefix = f"t:{uuid.uuid4().hex}:"
    key = _key("ttl")
    src = _randn(8, 8)
    with RedisECStore(redis_url, prefix=prefix, ttl_s=1) as s, redis.Redis.from_url(redis_url) as r:
        assert s.put(key, src)
        assert 0 < r.pttl(s.data_key(key)) <= 1000
        time.sleep(0.5)
        assert s.get(key) is not None
        assert r.pttl(s.data_key(key)) > 800  # get refreshed the TTL
        time.sleep(1.2)
        assert not s.exists(key)
        assert s.get(key) is None
        assert s.stats() == type(s.stats())(bytes_used=0, entries=0)
        assert s.put(key, src) is True


def test_large_entry_round_trip(store: ECStore) -> None:
    key = _key("large")
    src = _randn(4096, 4096)  # 64 MiB
    assert store.put(key, src, {"big": "yes"})
    entry = store.get(key)
    assert torch.equal(entry.tensor, src) and entry.meta == {"big": "yes"}
    assert store.stats().bytes_used > 64 * MiB


# -- keys and factory ----------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".hidden", "x" * 201, "k y", "é"])
def test_invalid_keys_rejected(store: ECStore, bad: str) -> None:
    with pytest.raises(ValueError, match="key"):
        store.put(bad, torch.zeros(1, 1))
    with pytest.raises(ValueError, match="key"):
        store.get(bad)
    with pytest.raises(ValueError, match="key"):
        store.exists(bad)


def test_open_ec_store_redis_url(redis_url: str) -> None:
    with open_ec_store(redis_url, ttl_s=5, max_bytes=MiB) as s:
        assert isinstance(s, RedisECStore) and (s.ttl_s, s.max_bytes) == (5, MiB)


def test_open_ec_store_urls(tmp_path: Path) -> None:
    with open_ec_store(f"file://{tmp_path}/a", max_bytes=MiB) as s:
        assert isinstance(s, FilesystemECStore) and s.root == tmp_path / "a"
    with open_ec_store(str(tmp_path / "b"), max_bytes=MiB) as s:
        assert isinstance(s, FilesystemECStore) and s.max_bytes == MiB
    with pytest.raises(ValueError, match="max_bytes"):
        open_ec_store(str(tmp_path / "c"))
    with pytest.raises(ValueError, match="ttl_s"):
        open_ec_store(str(tmp_path / "c"), max_bytes=MiB, ttl_s=3)
    with pytest.raises(ValueError, match="unsupported"):
        open_ec_store("s3://bucket/x")


# -- codec ---------------------------------------------------------------------


def _split(buf: bytes) -> tuple[dict, bytes]:
    (hlen,) = struct.unpack_from("<I", buf, len(MAGIC))
    start = len(MAGIC) + 4
    return json.loads(buf[start : start + hlen]), buf[start + hlen :]


def _join(header: dict, payload: bytes) -> bytes:
    h = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(h)) + h + payload


def test_codec_layout() -> None:
    src = _randn(3, 5, torch.bfloat16)
    buf = encode_entry(src, {"a": "b"})
    header, payload = _split(buf)
    assert buf.startswith(MAGIC)
    assert header["shape"] == [3, 5] and header["width"] == 5 and header["dtype"] == "bfloat16"
    assert header["nbytes"] == len(payload) == 3 * 5 * 2
    assert payload == src.view(torch.uint8).numpy().tobytes()


def test_codec_bad_magic() -> None:
    buf = encode_entry(_randn(2, 2))
    with pytest.raises(ECCorruptEntryError, match="magic"):
        decode_entry(b"XXXXXX\n" + buf[len(MAGIC) :])


@pytest.mark.parametrize(
    "field_, value, match",
    [
        ("nbytes", 999, "nbytes"),
        ("shape", [4, 4], "nbytes"),
        ("width", 7, "width"),
        ("dtype", "int64", "dtype"),
        ("shape", [4], "shape"),
        ("meta", {"a": 1}, "meta"),
    ],
)
def test_codec_header_mismatch(field_: str, value: object, match: str) -> None:
    header, payload = _split(encode_entry(_randn(2, 4)))
    header[field_] = value
    with pytest.raises(ECCorruptEntryError, match=match):
        decode_entry(_join(header, payload))


def test_codec_payload_checks() -> None:
    buf = encode_entry(_randn(4, 4))
    with pytest.raises(ECCorruptEntryError, match="truncated"):
        decode_entry(buf[:-1])
    with pytest.raises(ECCorruptEntryError, match="blake3"):
        decode_entry(buf[:-1] + bytes([buf[-1] ^ 0x80]))
    with pytest.raises(ECCorruptEntryError, match="header"):
        decode_entry(buf[: len(MAGIC) + 10])
    with pytest.raises(ECCorruptEntryError, match="shorter"):
        decode_entry(MAGIC)


def test_codec_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="2-D"):
        encode_entry(torch.zeros(2, 2, 2))
    with pytest.raises(ValueError, match="dtype"):
        encode_entry(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="meta"):
        encode_entry(torch.zeros(2, 2), {"a": 1})  # type: ignore[dict-item]


def test_codec_empty_and_noncontiguous() -> None:
    empty = torch.zeros(0, 8, dtype=torch.float16)
    assert decode_entry(encode_entry(empty)).tensor.shape == (0, 8)
    nc = _randn(8, 6).t()  # non-contiguous view
    assert torch.equal(decode_entry(encode_entry(nc)).tensor, nc)


# -- 2. concurrent producers (real processes; last, so their startup overlaps the rest)

# Long-lived producer processes, shared by both backends (torch import is slow).
# Each job line names a store and a wall-clock start time, so all producers
# call put() at the same instant.
_PRODUCER = r"""
import json, sys, time
import torch
from connectors.ec import open_ec_store
src = torch.randn(512, 2048, generator=torch.Generator().manual_seed(7))
print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    with open_ec_store(job["url"], **job["kw"]) as store:
        time.sleep(max(0.0, job["start_at"] - time.time()))
        stored = store.put(job["key"], src, {"who": "producer"})
        entry = store.wait(job["key"], 10)
        print(json.dumps({"stored": stored, "equal": torch.equal(entry.tensor, src)}), flush=True)
"""


@pytest.fixture(scope="module", autouse=True)
def _spawned_producers():
    """Start producers with the module so their torch import overlaps other tests."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PRODUCER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env=env,
        )
        for _ in range(3)
    ]
    yield procs
    for p in procs:  # idle by now: no need to wait for a slow torch shutdown
        p.terminate()
        p.wait(timeout=10)


@pytest.fixture(scope="module")
def producers(_spawned_producers):
    for p in _spawned_producers:
        assert p.stdout.readline().strip() == "ready"
    return _spawned_producers


def test_concurrent_producers_one_key(backend: Backend, store: ECStore, producers) -> None:
    key = _key("race")
    job = json.dumps({"url": backend.url, "kw": backend.kw, "key": key, "start_at": time.time() + 0.3})
    for p in producers:
        p.stdin.write(job + "\n")
        p.stdin.flush()
    results = [json.loads(p.stdout.readline()) for p in producers]
    assert sum(r["stored"] for r in results) == 1, results
    assert all(r["equal"] for r in results), results
    entry = store.get(key)
    assert torch.equal(entry.tensor, _randn(512, 2048, seed=7))
    assert entry.meta == {"who": "producer"}
    assert store.stats().entries == 1
