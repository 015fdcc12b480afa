"""The Lua scripts behind `RedisClusterPrefixIndex` (schema and reasons in redis_cluster_index.py).

Each script touches the keys of one hash tag only, so it runs on one shard: the worker scripts get
the worker's state HASH and block SET (tag `{w:...}`), the registry scripts the live ZSET and the
epochs HASH (tag of the namespace). No script touches a block's holder map: those are written by plain
pipelined commands, shard by shard, after the worker script said which events are new.
Deadlines are the shard's own clock (TIME); epochs travel as decimal strings (beyond a double's 53 bits).
"""

from __future__ import annotations

_PRELUDE = r"""
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Decimal strings without leading zeros: the longer is larger, equal lengths compare as text.
local function newer(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end

-- The worker's whole state, gone; the hashes it held (pool or host tier), for the caller to clear from
-- their holder maps.
local function forget(state, blocks, host)
  local held = redis.call('SUNION', blocks, host)
  redis.call('UNLINK', state, blocks, host)
  return held
end

local function reply(status, base, dropped)
  local out = {status, base}
  for _, h in ipairs(dropped) do out[#out + 1] = h end
  return out
end

local function each_hash_chunk(packed, fn)
  local n = #packed / 16
  local i = 0
  while i < n do
    local stop = math.min(n, i + 1000)
    local chunk = {}
    for j = i, stop - 1 do chunk[#chunk + 1] = string.sub(packed, j * 16 + 1, j * 16 + 16) end
    fn(chunk)
    i = stop
  end
end
"""

# KEYS: state, blocks, host. ARGV: epoch, lease_ms, last_seq, kind, then
#   kind 's': the number k of pool chunks, k chunks of the pool's packed hashes, then the host tier's;
#   kind 'e': first_seq, then per event '+' / '-' (pool) or '>' / '<' (host tier), packed hashes.
# Returns {status, base_seq, dropped hashes...}: status 'ok' (apply events after base_seq to the holder
# maps, after clearing the dropped hashes), or 'stale-epoch' / 'stale' / 'gap' (apply no event; the
# dropped hashes, if any, are still to be cleared).
WORKER_APPLY = (
    _PRELUDE
    + r"""
local state, blocks, host = KEYS[1], KEYS[2], KEYS[3]
local epoch, lease_ms, last_seq, kind = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local now = now_ms()
local cur = redis.call('HMGET', state, 'epoch', 'seq', 'deadline')
local base = 0
local dropped = {}
if cur[1] then
  local live = tonumber(cur[3]) > now
  if live and newer(cur[1], epoch) then return {'stale-epoch', 0} end
  if live and cur[1] == epoch and cur[2] then
    base = tonumber(cur[2])
  elseif live and cur[1] == epoch and kind ~= 's' then
    return {'gap', 0}  -- its holder maps are suspect (a write failed half way): only a snapshot mends them
  else
    dropped = forget(state, blocks, host)
  end
end
if last_seq < base then return reply('stale', 0, dropped) end
if kind == 's' then
  for _, h in ipairs(forget(state, blocks, host)) do dropped[#dropped + 1] = h end
  local pool_chunks = tonumber(ARGV[5])
  for i = 6, #ARGV do
    local into = (i < 6 + pool_chunks) and blocks or host
    each_hash_chunk(ARGV[i], function(c) redis.call('SADD', into, unpack(c)) end)
  end
else
  local first = tonumber(ARGV[5])
  if first > base + 1 then return reply('gap', 0, dropped) end
  for i = 6, #ARGV, 2 do
    if first + (i - 6) / 2 > base then
      local op = ARGV[i]
      local cmd = (op == '+' or op == '>') and 'SADD' or 'SREM'
      local into = (op == '+' or op == '-') and blocks or host
      each_hash_chunk(ARGV[i + 1], function(c) redis.call(cmd, into, unpack(c)) end)
    end
  end
end
redis.call('HSET', state, 'epoch', epoch, 'seq', ARGV[3], 'deadline', now + lease_ms)
return reply('ok', base, dropped)
"""
)

# KEYS: state. Marks the worker's holder maps suspect: its cursor is gone, so its next batch must be a
# snapshot (the publisher sends one when `cursor` says None).
WORKER_SUSPECT = r"""
redis.call('HDEL', KEYS[1], 'seq')
return 'ok'
"""

# KEYS: state, blocks, host. ARGV: epoch, lease_ms. Returns {status, dropped hashes...}.
WORKER_HEARTBEAT = (
    _PRELUDE
    + r"""
local state, blocks, host, epoch = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local now = now_ms()
local cur = redis.call('HMGET', state, 'epoch', 'deadline')
if not cur[1] or tonumber(cur[2]) <= now then return {'unknown'} end
if cur[1] == epoch then
  redis.call('HSET', state, 'deadline', now + tonumber(ARGV[2]))
  return {'ok'}
end
if newer(epoch, cur[1]) then
  local out = {'restarted'}
  for _, h in ipairs(forget(state, blocks, host)) do out[#out + 1] = h end
  return out
end
return {'stale-epoch'}
"""
)

# KEYS: state, blocks, host. ARGV: only_if_expired ('1' / '0'). Returns the hashes it held (cleared by the caller).
WORKER_FORGET = (
    _PRELUDE
    + r"""
local deadline = redis.call('HGET', KEYS[1], 'deadline')
if not deadline then return {} end
if ARGV[1] == '1' and tonumber(deadline) > now_ms() then return {} end
return forget(KEYS[1], KEYS[2], KEYS[3])
"""
)

# KEYS: state. Returns {epoch, seq} of a live worker with a cursor, else nil.
WORKER_CURSOR = (
    _PRELUDE
    + r"""
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'seq', 'deadline')
if not cur[1] or not cur[2] or tonumber(cur[3]) <= now_ms() then return nil end
return {cur[1], cur[2]}
"""
)

# KEYS: live ZSET, epochs HASH. ARGV: worker, epoch, lease_ms. Registers the worker's lease and epoch;
# returns the workers whose lease ended (trimmed here, for the caller to reap).
REGISTRY_TOUCH = (
    _PRELUDE
    + r"""
local now = now_ms()
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, w in ipairs(expired) do
  redis.call('ZREM', KEYS[1], w)
  redis.call('HDEL', KEYS[2], w)
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return expired
"""
)

# KEYS: live ZSET, epochs HASH. ARGV: worker.
REGISTRY_REMOVE = r"""
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 'ok'
"""

# KEYS: live ZSET, epochs HASH. Returns {worker, epoch, ...} of the live workers.
REGISTRY_LIVE = (
    _PRELUDE
    + r"""
local out = {}
for _, w in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now_ms(), '+inf')) do
  local e = redis.call('HGET', KEYS[2], w)
  if e then
    out[#out + 1] = w
    out[#out + 1] = e
  end
end
return out
"""
)
