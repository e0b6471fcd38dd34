-- A worker's heartbeat: registers it, renews its leases, brings back turns whose
-- lease expired (their worker died or stalled), forgets dead workers, and (an idle
-- worker's) wakes a worker for a turn left due.
-- KEYS[Q_NKEYS+1] workers ZSET (identity -> last heartbeat ms), KEYS[Q_NKEYS+2]
-- worker info HASH (identity -> JSON). ARGV: lease_ms, max_deliveries, identity,
-- info JSON (or '' to skip registering; '=' to register with the info this worker last
-- wrote, unchanged), forget_ms (a registration silent this long is forgotten, and the
-- fleet counted — 0: neither on this beat; liveness is judged on reading, by each
-- worker's own lease), reclaim_limit (0: no look for expired leases; `limit:not_after`:
-- none either when the script runs past not_after, server ms),
-- dead_keep_ms (the dead set's retention), then id, epoch pairs of the leases
-- this worker holds.
-- Returns {reclaimed, buried, fleet, now, resend, lost id...}: fleet is how many workers beat
-- in the last 30 s (the fetchers' safety nets scale with it; -1 on a beat that takes
-- no census); now is the server's clock (ms: an idle worker's cheap looks
-- between beats compare the first lease's expiry with it); resend is 1 when a
-- registration without its info found none (the worker was forgotten, or Redis lost
-- it): the next sends it; lost ids are leases it no longer holds.
local lease_ms, maxd = tonumber(ARGV[1]), tonumber(ARGV[2])
-- How long a turn may stay due, untaken, before an idle worker's beat wakes one for it.
local Q_STRAY_MS = 500
local workers, info = KEYS[Q_NKEYS + 1], KEYS[Q_NKEYS + 2]
local now = q_now()
local registering = ARGV[4] ~= ''
local out = {0, 0, -1, now, 0}
if registering then
  local added = redis.call('ZADD', workers, now, ARGV[3])
  if ARGV[4] ~= '=' then
    redis.call('HSET', info, ARGV[3], ARGV[4])
  elseif added == 1 then
    out[5] = 1
  end
end
local n = (#ARGV - 7) / 2
if n > 0 then
  local ids = {}
  for i = 1, n do ids[i] = ARGV[6 + 2 * i] end
  local recs = redis.call('HMGET', Q_JOBS, unpack(ids))
  local zadd = {}
  -- (One score for all, as text once: a number is formatted again for each argument.)
  local renewed = string.format('%d', now + lease_ms)
  for i = 1, n do
    -- (The record's epoch and flag alone, as text — q_decode would copy its payload
    -- out: 2.4 µs a lease, not 3.9, measured with redis-benchmark on 16 leases. The
    -- epoch is the integer q_encode wrote, and the worker sends it as one. What is
    -- left of a lease's cost is mostly a value read into Lua for each: 520 µs a beat
    -- of 256 leases, 160 without the HMGET; reading their scores instead (ZMSCORE)
    -- cost as much — BENCHMARKS.md, 2026-12-06 sixth.)
    local epoch, flag = nil, nil
    if recs[i] then epoch, flag = string.match(recs[i], '^(%d+)|%d+|(%a)|') end
    if flag == 'l' and epoch == ARGV[7 + 2 * i] then
      zadd[#zadd + 1] = renewed; zadd[#zadd + 1] = ids[i]
    else
      out[#out + 1] = ids[i]
    end
  end
  if #zadd > 0 then redis.call('ZADD', Q_LEASE, unpack(zadd)) end
end
-- A worker with no leases is idle, listening for tokens: a turn due a while and not
-- taken lost its wake-up (a watch whose worker died, a token popped by a worker that
-- died before it fetched), and is woken for here — by an idle worker's registering
-- beat (the fleet's come every few seconds) — so the workers' safety-net looks can be
-- rare.
if n == 0 and registering then
  local first = redis.call('ZRANGE', Q_DUE, 0, 0, 'WITHSCORES')
  if first[2] and tonumber(first[2]) <= now - Q_STRAY_MS then q_wake() end
end
-- (A reclaim limit of 0: a beat that only registers; the worker's looks find what expired.
-- `limit:not_after`: no reclaim when this runs past not_after, server ms — a beat that
-- reached Redis only after an outage, retried through it by its client, finds every lease
-- expired, its holders alive and about to renew: it leaves them.)
local expired = {}
local limit, not_after = string.match(ARGV[6], '^(%d+):?(%-?%d*)$')
limit = tonumber(limit) or 0
if limit > 0 and (not_after == '' or now <= tonumber(not_after)) then
  expired = redis.call('ZRANGEBYSCORE', Q_LEASE, '-inf', now, 'LIMIT', 0, limit)
end
for _, id in ipairs(expired) do
  local r = q_read(id)
  if not r or r.flag ~= 'l' then
    redis.call('ZREM', Q_LEASE, id)
  elseif r.deliveries >= maxd then
    q_unfence(id, r.epoch)
    q_bury(id, r, 'lease expired on delivery ' .. r.deliveries .. ' of ' .. maxd
      .. ': its worker was killed or stalled each time', now, ARGV[7])
    out[2] = out[2] + 1
  else
    q_unfence(id, r.epoch)
    q_schedule(id, r, now, now)
    out[1] = out[1] + 1
  end
end
-- A census (forget_ms > 0): silent registrations forgotten, the fleet counted.
if registering and tonumber(ARGV[5]) > 0 then
  local gone = redis.call('ZRANGEBYSCORE', workers, '-inf', now - tonumber(ARGV[5]), 'LIMIT', 0, 100)
  if #gone > 0 then
    redis.call('ZREM', workers, unpack(gone))
    redis.call('HDEL', info, unpack(gone))
  end
  out[3] = redis.call('ZCOUNT', workers, now - 30000, '+inf')
end
return out
