"""The Lua scripts behind `RedisPrefixIndex` (schema and reasons in redis_index.py's docstring).

Each script runs atomically on the server, so the epoch / cursor checks and the writes they guard can
never interleave with another client, and a lookup costs one round trip. Every script gets the
namespace's key prefix as ARGV[1] and its registry key as KEYS[1] (so that a cluster-aware client
could route by its hash-tagged slot); key names are built here, in one place (`wkey`, `bkey`).
Epochs travel as decimal strings: nanosecond clocks exceed the 53 bits a Lua number holds exactly.
"""

from __future__ import annotations

_PRELUDE = r"""
local P = ARGV[1]
local WORKERS = KEYS[1]  -- == P .. ':workers'
local function wkey(w) return P .. ':w:' .. w end
local function bkey(w, e) return P .. ':b:' .. w .. ':' .. e end
local function hkey(w, e) return P .. ':h:' .. w .. ':' .. e end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Decimal strings without leading zeros: the longer is larger, equal lengths compare as text.
local function newer(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end

local function forget(w)
  local e = redis.call('HGET', wkey(w), 'epoch')
  if e then redis.call('UNLINK', bkey(w, e), hkey(w, e)) end  -- UNLINK frees a large set off the main thread
  redis.call('UNLINK', wkey(w))
  redis.call('ZREM', WORKERS, w)
end

-- One deadline for the worker's places (registry score, cursor, block sets), so they vanish
-- together; dead workers' registry entries are trimmed here, by whichever worker writes next.
local function touch(w, e, lease_ms)
  local now = now_ms()
  local deadline = now + lease_ms
  redis.call('ZREMRANGEBYSCORE', WORKERS, '-inf', now)
  redis.call('ZADD', WORKERS, deadline, w)
  redis.call('PEXPIREAT', wkey(w), deadline)
  redis.call('PEXPIREAT', bkey(w, e), deadline)
  redis.call('PEXPIREAT', hkey(w, e), deadline)
  local last = redis.call('ZRANGE', WORKERS, '+inf', '-inf', 'BYSCORE', 'REV', 'LIMIT', 0, 1, 'WITHSCORES')
  redis.call('PEXPIREAT', WORKERS, last[2])
end

-- Calls fn on tables of at most 1000 hashes: unpack() is bounded by Lua's C stack (8000 slots).
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

# ARGV: prefix, worker, epoch, lease_ms, last_seq, kind, then
#   kind 's': the number k of pool chunks, then k chunks of the pool's packed hashes, then the host tier's;
#   kind 'e': first_seq, then per event: '+' / '-' (pool stored / removed) or '>' / '<' (host tier
#   stored / removed), packed hashes.
APPLY = (
    _PRELUDE
    + r"""
local w, epoch, lease_ms, last_seq, kind = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local cur = redis.call('HMGET', wkey(w), 'epoch', 'seq')
local base = 0
if cur[1] then
  if newer(cur[1], epoch) then return 'stale-epoch' end
  if cur[1] == epoch then base = tonumber(cur[2]) else forget(w) end
end
if last_seq < base then return 'stale' end
local blocks, host = bkey(w, epoch), hkey(w, epoch)
if kind == 's' then
  redis.call('UNLINK', blocks, host)
  local pool_chunks = tonumber(ARGV[7])
  for i = 8, #ARGV do
    local into = (i < 8 + pool_chunks) and blocks or host
    each_hash_chunk(ARGV[i], function(c) redis.call('SADD', into, unpack(c)) end)
  end
else
  local first = tonumber(ARGV[7])
  if first > base + 1 then return 'gap' end
  for i = 8, #ARGV, 2 do
    if first + (i - 8) / 2 > base then
      local op = ARGV[i]
      local cmd = (op == '+' or op == '>') and 'SADD' or 'SREM'
      local into = (op == '+' or op == '-') and blocks or host
      each_hash_chunk(ARGV[i + 1], function(c) redis.call(cmd, into, unpack(c)) end)
    end
  end
end
redis.call('HSET', wkey(w), 'epoch', epoch, 'seq', ARGV[5])
touch(w, epoch, lease_ms)
return 'ok'
"""
)

# ARGV: prefix, worker, epoch, lease_ms.
HEARTBEAT = (
    _PRELUDE
    + r"""
local w, epoch = ARGV[2], ARGV[3]
local e = redis.call('HGET', wkey(w), 'epoch')
if not e then return 'unknown' end
if e == epoch then
  touch(w, epoch, tonumber(ARGV[4]))
  return 'ok'
end
if newer(epoch, e) then
  forget(w)
  return 'restarted'
end
return 'stale-epoch'
"""
)

# ARGV: prefix, worker.
REMOVE = (
    _PRELUDE
    + r"""
forget(ARGV[2])
return 'ok'
"""
)

# ARGV: prefix, block hashes (raw) in prompt order. Returns {worker, pool count, host count, ...}: the
# leading blocks in the worker's pool, then how far its host tier (or pool) continues the chain.
# Membership is asked in growing chunks: most workers miss early, long prompts rarely match whole.
MATCH = (
    _PRELUDE
    + r"""
local total = #ARGV - 1
-- From block `n` on, how far `key` holds the chain; a block it lacks still counts if `also` holds it.
local function leading(key, n, also)
  local size = 32
  while n < total do
    local stop = math.min(total, n + size)
    local flags = redis.call('SMISMEMBER', key, unpack(ARGV, n + 2, stop + 1))
    for _, flag in ipairs(flags) do
      if flag == 0 and not (also and redis.call('SISMEMBER', also, ARGV[n + 2]) == 1) then return n end
      n = n + 1
    end
    size = math.min(size * 2, 1000)
  end
  return n
end
local out = {}
for _, w in ipairs(redis.call('ZRANGEBYSCORE', WORKERS, '(' .. now_ms(), '+inf')) do
  local e = redis.call('HGET', wkey(w), 'epoch')
  if e then
    local n = leading(bkey(w, e), 0, nil)
    local reach = n
    if redis.call('EXISTS', hkey(w, e)) == 1 then reach = leading(hkey(w, e), n, bkey(w, e)) end
    if reach > 0 then
      out[#out + 1] = w
      out[#out + 1] = n
      out[#out + 1] = reach - n
    end
  end
end
return out
"""
)

# ARGV: prefix. Returns a list of problems (empty when consistent). KEYS is fine here: tests only.
INTEGRITY = (
    _PRELUDE
    + r"""
local problems = {}
local function bad(msg) problems[#problems + 1] = msg end
for _, k in ipairs(redis.call('KEYS', P .. ':*')) do
  local expire_at = redis.call('PEXPIRETIME', k)
  if expire_at < 0 then bad(k .. ' never expires') end
  local rest = string.sub(k, #P + 2)
  local w = string.match(rest, '^w:(.*)$')
  local bw, be = string.match(rest, '^b:(.*):(%d+)$')
  if not bw then bw, be = string.match(rest, '^h:(.*):(%d+)$') end
  if w then
    local st = redis.call('HMGET', k, 'epoch', 'seq')
    if not st[1] or not tonumber(st[2]) then bad(k .. ' lacks epoch or seq') end
    local score = redis.call('ZSCORE', WORKERS, w)
    if not score or tonumber(score) ~= expire_at then bad(k .. ' expires apart from its registry lease') end
  elseif bw then
    if redis.call('HGET', wkey(bw), 'epoch') ~= be then bad(k .. ' belongs to a dropped or unknown epoch') end
    if redis.call('PEXPIRETIME', wkey(bw)) ~= expire_at then bad(k .. ' expires apart from its worker') end
    for _, m in ipairs(redis.call('SMEMBERS', k)) do
      if #m ~= 16 then
        bad(k .. ' holds a malformed hash')
        break
      end
    end
  elseif rest ~= 'workers' then
    bad(k .. ' is not part of the schema')
  end
end
return problems
"""
)

COUNT = (
    _PRELUDE
    + r"""
local total = 0
for _, w in ipairs(redis.call('ZRANGEBYSCORE', WORKERS, '(' .. now_ms(), '+inf')) do
  local e = redis.call('HGET', wkey(w), 'epoch')
  if e then total = total + redis.call('SCARD', bkey(w, e)) + redis.call('SCARD', hkey(w, e)) end
end
return total
"""
)
