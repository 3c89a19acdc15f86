"""Redis EC store.

Layout under `prefix` (single Redis node; not cluster-safe):
  <prefix>e:<key>   encoded entry (string)
  <prefix>lru       sorted set key -> last access tick (LRU order)
  <prefix>size      hash key -> encoded bytes
  <prefix>bytes     total encoded bytes of indexed entries
  <prefix>clock     access counter used as the LRU tick (strictly increasing)

Invariants:
- Every mutation of the index runs inside one Lua script, so the index, the
  byte counter and the data keys change atomically together.
- put is SET NX: the first writer of a key wins, later puts return False.
- With a TTL, every access refreshes both the TTL and the LRU tick, so entries
  expire in LRU order; scripts first drop index heads whose data key is gone.
"""

from __future__ import annotations

from collections.abc import Mapping

import redis
import torch

from connectors.ec.base import ECCorruptEntryError, ECEntry, ECStats, ECStore, validate_key
from connectors.ec.codec import decode_entry, encode_entry, payload_nbytes

MAX_ENTRY_BYTES = 512 * 1024 * 1024  # Redis string / bulk-argument limit

# Shared Lua helpers. ARGV[1] is always the key prefix.
_LUA_LIB = """
local P = ARGV[1]
local LRU, SIZE, BYTES, CLOCK = P..'lru', P..'size', P..'bytes', P..'clock'

local function drop(m)
  local existed = redis.call('DEL', P..'e:'..m)
  local sz = tonumber(redis.call('HGET', SIZE, m) or '0')
  redis.call('HDEL', SIZE, m)
  local indexed = redis.call('ZREM', LRU, m)
  if sz > 0 then redis.call('DECRBY', BYTES, sz) end
  return existed + indexed
end

local function purge_expired()
  while true do
    local head = redis.call('ZRANGE', LRU, 0, 0)[1]
    if not head or redis.call('EXISTS', P..'e:'..head) == 1 then return end
    drop(head)
  end
end

local function touch(m, ttl)
  redis.call('ZADD', LRU, 'XX', redis.call('INCR', CLOCK), m)
  if ttl > 0 then redis.call('EXPIRE', P..'e:'..m, ttl) end
end
"""

# ARGV: prefix, key, value, ttl (0 = none), max_bytes (-1 = none). Returns 1 if stored.
_PUT = _LUA_LIB + """
local m, val, ttl, maxb = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local dk = P..'e:'..m
if redis.call('EXISTS', dk) == 1 then
  touch(m, ttl)
  return 0
end
if ttl > 0 then redis.call('SET', dk, val, 'EX', ttl) else redis.call('SET', dk, val) end
local stale = redis.call('HGET', SIZE, m)  -- index left over from an expired copy
if stale then redis.call('DECRBY', BYTES, tonumber(stale)) end
redis.call('ZADD', LRU, redis.call('INCR', CLOCK), m)
redis.call('HSET', SIZE, m, #val)
redis.call('INCRBY', BYTES, #val)
purge_expired()
local total = tonumber(redis.call('GET', BYTES))
while maxb >= 0 and total > maxb do
  local head = redis.call('ZRANGE', LRU, 0, 0)[1]
  if not head or head == m then break end
  drop(head)
  total = tonumber(redis.call('GET', BYTES) or '0')
end
return 1
"""

# ARGV: prefix, key, ttl. Returns the value or nil; refreshes LRU tick and TTL.
_GET = _LUA_LIB + """
local m, ttl = ARGV[2], tonumber(ARGV[3])
local val = redis.call('GET', P..'e:'..m)
if val then touch(m, ttl) end
return val
"""

# ARGV: prefix, key. Returns 1 if anything was removed.
_DELETE = _LUA_LIB + """
if drop(ARGV[2]) > 0 then return 1 end
return 0
"""

# ARGV: prefix. Returns {bytes, entries}.
_STATS = _LUA_LIB + """
purge_expired()
return {tonumber(redis.call('GET', BYTES) or '0'), redis.call('ZCARD', LRU)}
"""


class RedisECStore(ECStore):
    def __init__(
        self,
        url: str,
        prefix: str = "epd:ec:",
        ttl_s: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        if ttl_s is not None and (not isinstance(ttl_s, int) or ttl_s <= 0):
            raise ValueError(f"ttl_s must be a positive int or None, got {ttl_s!r}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._r = redis.Redis.from_url(url, decode_responses=False)
        self._put = self._r.register_script(_PUT)
        self._get = self._r.register_script(_GET)
        self._delete = self._r.register_script(_DELETE)
        self._stats = self._r.register_script(_STATS)

    def data_key(self, key: str) -> str:
        """Redis key holding key's entry (for diagnostics and tests)."""
        return f"{self.prefix}e:{validate_key(key)}"

    def _limit(self) -> int:
        return min(MAX_ENTRY_BYTES, self.max_bytes or MAX_ENTRY_BYTES)

    def _check_size(self, key: str, size: int) -> None:
        if size > self._limit():
            raise ValueError(
                f"EC entry {key!r} is {size} bytes, over the limit of {self._limit()} bytes "
                f"(Redis max {MAX_ENTRY_BYTES}, max_bytes={self.max_bytes})"
            )

    def put(self, key: str, tensor: torch.Tensor, meta: Mapping[str, str] | None = None) -> bool:
        validate_key(key)
        self._check_size(key, payload_nbytes(tensor))  # before encoding copies it
        value = encode_entry(tensor, meta)
        self._check_size(key, len(value))
        args = [self.prefix, key, value, self.ttl_s or 0, -1 if self.max_bytes is None else self.max_bytes]
        return self._put(keys=[], args=args) == 1

    def exists(self, key: str) -> bool:
        return self._r.exists(self.data_key(key)) == 1

    def get(self, key: str) -> ECEntry | None:
        validate_key(key)
        value = self._get(keys=[], args=[self.prefix, key, self.ttl_s or 0])
        if value is None:
            return None
        try:
            return decode_entry(value)
        except ECCorruptEntryError as e:
            self.delete(key)
            raise ECCorruptEntryError(f"EC entry {key!r} in Redis: {e}") from None

    def delete(self, key: str) -> bool:
        validate_key(key)
        return self._delete(keys=[], args=[self.prefix, key]) == 1

    def stats(self) -> ECStats:
        nbytes, entries = self._stats(keys=[], args=[self.prefix])
        return ECStats(bytes_used=int(nbytes), entries=int(entries))

    def close(self) -> None:
        self._r.close()
