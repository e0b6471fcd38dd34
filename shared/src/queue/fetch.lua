-- Fetch and lease up to ARGV[1] due turns for ARGV[2] ms (ARGV[3]: the dead
-- set's retention, ms). KEYS[Q_NKEYS+1]: the epoch counter; KEYS[Q_NKEYS+2]: the
-- queue's counters (empty_fetches: a worker woken for nothing is a cost to count). Returns {now, wait_ms, id, epoch, deliveries, due, payload, ...}:
-- wait_ms is, when nothing was due, how long until the next due turn (-1: none).
local max, lease_ms, dead_keep_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local now = q_now()
local due = redis.call('ZRANGEBYSCORE', Q_DUE, '-inf', now, 'WITHSCORES', 'LIMIT', 0, max)
local n = #due / 2
if n == 0 then
  -- Nothing due: the tokens are spent, and this worker now sleeps towards the
  -- earliest due time itself, so no other worker needs waking for it.
  redis.call('DEL', Q_NOTIFY)
  redis.call('HINCRBY', KEYS[Q_NKEYS + 2], 'empty_fetches', 1)
  local nxt = redis.call('ZRANGE', Q_DUE, 0, 0, 'WITHSCORES')
  if #nxt == 0 then return {tostring(now), '-1'} end
  return {tostring(now), tostring(tonumber(nxt[2]) - now)}
end
local ids = {}
for i = 1, n do ids[i] = due[2 * i - 1] end
redis.call('ZREM', Q_DUE, unpack(ids))
local recs = redis.call('HMGET', Q_JOBS, unpack(ids))
-- Epochs come from one counter, so an epoch is never reused, even by a later
-- turn under the same id.
local first = redis.call('INCRBY', KEYS[Q_NKEYS + 1], n) - n
local out = {tostring(now), '0'}
local hset, zadd = {}, {}
for i = 1, n do
  local r = q_decode(recs[i])
  if r and r.flag == 'q' then
    r.epoch = first + i
    r.deliveries = r.deliveries + 1
    r.flag = 'l'
    hset[#hset + 1] = ids[i]; hset[#hset + 1] = q_encode(r)
    zadd[#zadd + 1] = now + lease_ms; zadd[#zadd + 1] = ids[i]
    out[#out + 1] = ids[i]; out[#out + 1] = tostring(r.epoch); out[#out + 1] = tostring(r.deliveries)
    out[#out + 1] = due[2 * i]; out[#out + 1] = r.payload
  elseif recs[i] and not r then
    -- A record this version cannot read: buried with its raw text, and its run
    -- failed, never dropped (a dropped turn left its run waiting forever).
    local dead = {epoch = 0, deliveries = 0, flag = 'd', payload = recs[i]}
    q_bury(ids[i], dead, 'unreadable queue record (written by another version?)', now, dead_keep_ms)
  end
end
if #hset > 0 then
  redis.call('HSET', Q_JOBS, unpack(hset))
  redis.call('ZADD', Q_LEASE, unpack(zadd))
end
if n < max then
  -- Took everything due: leftover tokens would only cause empty fetches.
  redis.call('DEL', Q_NOTIFY)
else
  -- There may be more: pass the baton, so 10 000 turns due at once are taken
  -- by every idle worker, not just this one.
  q_wake()
end
return out
