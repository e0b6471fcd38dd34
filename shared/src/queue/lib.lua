-- paceline turn queue: the Lua library every queue script starts with.
--
-- Prepend this file (Rust: shared::queue::LUA_LIB) to a script and pass the
-- queue's seven keys FIRST, in this order (Rust: QueueKeys::script_keys()):
--   KEYS[1] due      ZSET  id -> due time (ms, Redis TIME); queued turns, ready or delayed
--   KEYS[2] lease    ZSET  id -> lease deadline (ms); turns in flight
--   KEYS[3] jobs     HASH  id -> record "epoch|deliveries|flag|payload" (flag q/l/d)
--   KEYS[4] dead     ZSET  id -> time it died (ms)
--   KEYS[5] reasons  HASH  id -> why it died
--   KEYS[6] notify   LIST  wake-up tokens that idle workers BLPOP
--   KEYS[7] timer    STRING "due_ms|worker": the one idle worker that sleeps towards
--                    the earliest delayed turn (the others wait for tokens alone)
-- A script's own keys start at KEYS[Q_NKEYS + 1]. ARGV is the script's own: the
-- library's functions take their inputs as arguments and never read ARGV.
-- Every function here is a `local`, so the library can be prepended to any body.
local Q_DUE, Q_LEASE, Q_JOBS, Q_DEAD, Q_REASONS, Q_NOTIFY, Q_TIMER =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local Q_NKEYS = 7
-- Tokens beyond this many wake nobody new; the chain token of a full fetch covers the rest.
local Q_MAX_TOKENS = 64

-- The Redis server's clock in ms: the one clock due times and leases use.
local function q_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A record's fields, or nil when there is no such turn.
local function q_decode(v)
  if not v then return nil end
  local e, d, f, p = string.match(v, '^(%d+)|(%d+)|(%a)|(.*)$')
  if not e then return nil end
  return {epoch = tonumber(e), deliveries = tonumber(d), flag = f, payload = p}
end

local function q_encode(r)
  return string.format('%d|%d|%s|', r.epoch, r.deliveries, r.flag) .. r.payload
end

-- The turn `id` as a table, or nil.
local function q_read(id)
  return q_decode(redis.call('HGET', Q_JOBS, id))
end

-- The fence: the caller holds the live lease of `id` at `epoch`. Returns the
-- record, or nil and why not ('gone': no such turn; 'not_leased': its lease
-- expired and it went back to the queue; 'stale': it was delivered again since).
-- Call it before any write a lease holder makes; on nil, write nothing.
local function q_fence(id, epoch)
  local r = q_read(id)
  if not r then return nil, 'gone' end
  if r.flag ~= 'l' then return nil, 'not_leased' end
  if r.epoch ~= tonumber(epoch) then return nil, 'stale' end
  return r
end

-- Wakes one idle worker (a new due time to sleep towards, or work to take).
local function q_wake()
  -- Trimmed well below the cap, so a busy queue pays for one LTRIM per ~50 pushes.
  if redis.call('LPUSH', Q_NOTIFY, '1') > Q_MAX_TOKENS then
    redis.call('LTRIM', Q_NOTIFY, 0, 15)
  end
end

-- The due time an idle worker sleeps towards and that worker, or nil: a claim
-- whose time has passed is its holder's to act on now, and anyone's to take over.
local function q_claim_of(t, now)
  if not t then return nil end
  local at, who = string.match(t, '^(%-?%d+)|(.*)$')
  at = tonumber(at)
  if not at or at <= now then return nil end
  return at, who
end
local function q_watched(now)
  return q_claim_of(redis.call('GET', Q_TIMER), now)
end

-- Wakes one idle worker to watch `due_ms` (server clock) with no fetch of its own: the
-- token names the time ('w' and the ms), and the watch is claimed for whoever takes it
-- ('*': a fetch takes such a claim over, fetch.lua). A worker that cannot read the
-- time fetches, as for any token. (The claim's expiry only tidies the key: a claim
-- whose time has passed is anyone's, q_claim_of.)
local function q_wake_at(due_ms, now)
  redis.call('SET', Q_TIMER, string.format('%d|*', due_ms), 'PX', math.max(due_ms - now, 1) + 60000)
  if redis.call('LPUSH', Q_NOTIFY, string.format('w%d', due_ms)) > Q_MAX_TOKENS then
    redis.call('LTRIM', Q_NOTIFY, 0, 15)
  end
end

-- Wakes one idle worker for a turn due at `due_ms`, unless one already sleeps
-- towards that time or an earlier one (it will take this turn when it wakes):
-- a due time reaches one worker process, however many are idle.
local function q_wake_for(due_ms, now)
  if due_ms <= now then return q_wake() end
  local watched = q_watched(now)
  if not watched or due_ms < watched then q_wake_at(due_ms, now) end
end

-- q_wake_for for a due time that is most likely the earliest (a budget line's head moved
-- up: the watch is for its old time, or for nothing): the claim set and the old one read
-- in one command, and put back when it was for this time or an earlier one. Returns
-- whether the claim for `due_ms` stands, to be watched: by whoever takes the token it
-- pushes, or, with `no_token`, by the caller's own process (runs/pacer_host.lua
-- `kicked`). A time already due wakes a fetch instead.
local function q_wake_first(due_ms, now, no_token)
  if due_ms <= now then
    q_wake()
    return false
  end
  local old = redis.call('SET', Q_TIMER, string.format('%d|*', due_ms), 'PX', math.max(due_ms - now, 1) + 60000, 'GET')
  local watched = q_claim_of(old, now)
  if watched and watched <= due_ms then
    redis.call('SET', Q_TIMER, old, 'PX', math.max(watched - now, 1) + 60000)
    return false
  end
  if not no_token and redis.call('LPUSH', Q_NOTIFY, string.format('w%d', due_ms)) > Q_MAX_TOKENS then
    redis.call('LTRIM', Q_NOTIFY, 0, 15)
  end
  return true
end

-- Adds a new turn `id` with `payload`, due at `due_ms` (server clock; `now`:
-- the script's), and wakes a worker for it; false (and nothing written) when
-- the id is already queued, in flight or dead.
local function q_add(id, payload, due_ms, now)
  local r = {epoch = 0, deliveries = 0, flag = 'q', payload = payload}
  if redis.call('HSETNX', Q_JOBS, id, q_encode(r)) == 0 then return false end
  redis.call('ZADD', Q_DUE, due_ms, id)
  q_wake_for(due_ms, now)
  return true
end

-- Puts turn `id` (record `r`, as read) in the queue, due at `due_ms` (server
-- clock; `now`: the script's), out of any lease. Set r.payload / r.deliveries
-- before calling to change them. `quiet`: wake nobody, because the caller's
-- process fetches as soon as this turn's handler returns (its fetcher waits
-- for a slot): it takes the turn, or takes a full batch and passes the baton.
local function q_schedule(id, r, due_ms, now, quiet)
  r.flag = 'q'
  redis.call('HSET', Q_JOBS, id, q_encode(r))
  redis.call('ZREM', Q_LEASE, id)
  redis.call('ZADD', Q_DUE, due_ms, id)
  -- A requeue for later (a budget wait) wakes nobody when a worker already
  -- sleeps towards an earlier time: it would only look and sleep again.
  if not quiet then q_wake_for(due_ms, now) end
end

-- Removes leased turn `id` for good (it is done).
local function q_finish(id)
  redis.call('ZREM', Q_LEASE, id)
  redis.call('HDEL', Q_JOBS, id)
end

-- What a turn's owner needs when a queue script ends a lease or buries a turn: hooks a
-- layer above sets (the run store's, runs/hooks.lua), so the queue names none of its
-- keys or fields. A queue used on its own has none.
--   Q_HOOKS.lease_ended(id, epoch): the lease at `epoch` of turn `id` ended (a reclaim, a
--     settle) while its holder may still be out;
--   Q_HOOKS.buried(id, reason, now): turn `id` went to the dead set.
local Q_HOOKS = {}

local function q_unfence(id, epoch)
  if Q_HOOKS.lease_ended then Q_HOOKS.lease_ended(id, epoch) end
end

-- The dead set's retention: turns dead for longer than `keep_ms` leave it, with
-- their reasons and records (at most 100 a call, the oldest first, so a bury stays
-- cheap; the set grows only by burying, so trimming there bounds it). Their runs
-- failed when they were buried and expire by their own retention.
local function q_trim_dead(now, keep_ms)
  local keep = tonumber(keep_ms)
  if not keep or keep <= 0 then return end
  local old = redis.call('ZRANGEBYSCORE', Q_DEAD, '-inf', now - keep, 'LIMIT', 0, 100)
  if #old == 0 then return end
  redis.call('ZREM', Q_DEAD, unpack(old))
  redis.call('HDEL', Q_REASONS, unpack(old))
  for _, id in ipairs(old) do
    local r = q_read(id)
    if r and r.flag == 'd' then redis.call('HDEL', Q_JOBS, id) end
  end
end

-- Moves turn `id` (record `r`) to the dead set with `reason`, and ends its run;
-- dead turns older than `keep_ms` (the dead set's retention) leave the set.
local function q_bury(id, r, reason, now, keep_ms)
  r.flag = 'd'
  redis.call('HSET', Q_JOBS, id, q_encode(r))
  redis.call('ZREM', Q_LEASE, id)
  redis.call('ZREM', Q_DUE, id)
  redis.call('ZADD', Q_DEAD, now, id)
  redis.call('HSET', Q_REASONS, id, reason)
  if Q_HOOKS.buried then Q_HOOKS.buried(id, reason, now) end
  q_trim_dead(now, keep_ms)
end
