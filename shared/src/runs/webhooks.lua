-- Webhook deliveries (runs/webhooks.rs): the script that ends a run enqueued its event
-- (runs/hooks.lua `webhook_enqueue`); workers claim the due ones, send them and finish
-- each here. Every time is the Redis server's clock.
-- KEYS[1] due (ZSET event -> due ms), KEYS[2] leased (ZSET event -> lease deadline ms),
-- KEYS[3] dead (ZSET event -> ms it gave up), KEYS[4] the senders' wake-up tokens
-- (LIST). ARGV[1] the op, ARGV[2] the base the event
-- and run keys share ('<prefix>:<slot>:', keys.rs `webhook_event`, `run_record`): an
-- event's id is learned as the script meets it.
local op, base = ARGV[1], ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function event_key(id) return base .. 'wh:e:' .. id end

-- The run object's `webhook` mirrors its current event's state (one HGETALL reads a run);
-- an earlier event of a re-driven run, or a run past its retention, is left alone.
local function mirror(run_id, event, fields)
  local run = base .. 'run:' .. run_id
  if redis.call('HGET', run, 'webhook_event') == event then redis.call('HSET', run, unpack(fields)) end
end

-- `id` dead-lettered now (`dead_ms`: how long it is kept there), with what went wrong.
local function bury(id, key, status, error, dead_ms)
  redis.call('ZADD', KEYS[3], now, id)
  -- Dead letters past their keep leave the set (their events expired with them).
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - dead_ms)
  redis.call('HSET', key, 'state', 'failed', 'last_status', status, 'error', error, 'next_ms', '', 'last_ms', now)
  redis.call('PEXPIRE', key, dead_ms)
  mirror(redis.call('HGET', key, 'run'), id, {'webhook_state', 'failed', 'webhook_attempts',
    redis.call('HGET', key, 'attempts'), 'webhook_last_status', status, 'webhook_next_ms', '', 'webhook_error', error})
end

if op == 'claim' then
  -- ARGV[3] lease ms, [4] at most this many, [5] the most one origin may have in
  -- flight in this worker, [6] how long a dead letter is kept (ms), [7] the attempts an
  -- event has (runs/webhooks.rs SCHEDULE), then origin, count pairs: what this worker
  -- sends to each now. A lease past its deadline (its worker
  -- died or stopped sending) is due again first — dead-lettered when it used its last
  -- attempt. Each claim is fenced by `claims`, a count never reset (a re-drive resets
  -- `attempts`, which the schedule reads).
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 100)) do
    redis.call('ZREM', KEYS[2], id)
    local key = event_key(id)
    if (tonumber(redis.call('HGET', key, 'attempts')) or 0) >= tonumber(ARGV[7]) then
      bury(id, key, '', 'its last attempt never finished: the worker sending it stopped', tonumber(ARGV[6]))
    else
      redis.call('ZADD', KEYS[1], now, id)
    end
  end
  local per_origin = tonumber(ARGV[5])
  local busy = {}
  for i = 8, #ARGV, 2 do busy[ARGV[i]] = tonumber(ARGV[i + 1]) end
  local want = tonumber(ARGV[4])
  local out = {}
  -- A bounded scan: past a backlog of one receiver at its bound, up to 256 due events
  -- are looked at, so one slow receiver does not hold back the others' deliveries.
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, math.max(want * 4, 256))) do
    if #out >= want then break end
    local key = event_key(id)
    local e = redis.call('HMGET', key, 'run', 'type', 'ms', 'url', 'tenant', 'body', 'origin')
    if not e[1] then
      -- Its event expired (a run long past its retention): nothing left to send.
      redis.call('ZREM', KEYS[1], id)
    elseif (busy[e[7] or ''] or 0) < per_origin then
      busy[e[7] or ''] = (busy[e[7] or ''] or 0) + 1
      local attempt = redis.call('HINCRBY', key, 'attempts', 1)
      local claim = redis.call('HINCRBY', key, 'claims', 1)
      redis.call('ZREM', KEYS[1], id)
      redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), id)
      redis.call('HSET', key, 'state', 'sending')
      out[#out + 1] = {id, e[1], e[2], e[3], e[4], e[5], tostring(attempt), e[6] or '', tostring(claim),
        e[7] or ''}
    end
  end
  -- When to look next: the first due event, or the first lease to lapse (a sender
  -- that dies leaves no token behind).
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]
  local lapse = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')[2]
  if lapse and (not first or tonumber(lapse) < tonumber(first)) then first = lapse end
  return {out, first or '', tostring(now)}
end

if op == 'finish' then
  -- ARGV[3] event, [4] its claim (`claims` when it was claimed), [5] delivered | stopped |
  -- retry, [6] the HTTP status ('' for none), [7] what went wrong ('' for nothing), [8] ms
  -- until the next attempt ('' : none left, it goes dead), [9] the body sent (kept: every
  -- attempt sends the same), [10] how long a finished event is kept, ms (a dead one: how
  -- long a dead letter is kept).
  local id = ARGV[3]
  local key = event_key(id)
  if redis.call('HGET', key, 'claims') ~= ARGV[4] or not redis.call('ZSCORE', KEYS[2], id) then
    return {'stale'}
  end
  redis.call('ZREM', KEYS[2], id)
  if ARGV[9] ~= '' then redis.call('HSETNX', key, 'body', ARGV[9]) end
  local state, next_ms = ARGV[5], ''
  if state == 'retry' and ARGV[8] == '' then
    bury(id, key, ARGV[6], ARGV[7], tonumber(ARGV[10]))
    return {'failed', ''}
  end
  if state == 'retry' then
    state = 'retrying'
    next_ms = now + tonumber(ARGV[8])
    redis.call('ZADD', KEYS[1], next_ms, id)
  end
  redis.call('HSET', key, 'state', state, 'last_status', ARGV[6], 'error', ARGV[7], 'next_ms', next_ms,
    'last_ms', now)
  if state ~= 'retrying' then redis.call('PEXPIRE', key, tonumber(ARGV[10])) end
  mirror(redis.call('HGET', key, 'run'), id, {'webhook_state', state, 'webhook_attempts',
    redis.call('HGET', key, 'attempts'), 'webhook_last_status', ARGV[6], 'webhook_next_ms', next_ms,
    'webhook_error', ARGV[7]})
  return {state, tostring(next_ms)}
end

if op == 'dead' then
  -- ARGV[3] at most this many: the newest dead deliveries, each
  -- {event, run, type, url, attempts, last status, error, ms it gave up}.
  local out = {}
  local ids = redis.call('ZREVRANGE', KEYS[3], 0, tonumber(ARGV[3]) - 1, 'WITHSCORES')
  for i = 1, #ids, 2 do
    local e = redis.call('HMGET', event_key(ids[i]), 'run', 'type', 'url', 'attempts', 'last_status', 'error')
    if e[1] then
      out[#out + 1] = {ids[i], e[1], e[2], e[3], e[4] or '0', e[5] or '', e[6] or '', ids[i + 1]}
    else
      redis.call('ZREM', KEYS[3], ids[i])
    end
  end
  return out
end

if op == 'redrive' then
  -- ARGV[3] event: a dead delivery due again now, its attempts counted from 0 (the
  -- operator fixed the receiver), kept ARGV[4] ms again (runs/webhooks.rs EVENT_KEPT). Its id, body and signature scheme stay the same.
  local id = ARGV[3]
  local key = event_key(id)
  if not redis.call('ZSCORE', KEYS[3], id) or redis.call('EXISTS', key) == 0 then return {'not_dead'} end
  redis.call('ZREM', KEYS[3], id)
  redis.call('PEXPIRE', key, tonumber(ARGV[4]))
  redis.call('HSET', key, 'attempts', 0, 'state', 'pending', 'next_ms', now)
  redis.call('ZADD', KEYS[1], now, id)
  redis.call('RPUSH', KEYS[4], 1)
  redis.call('LTRIM', KEYS[4], -64, -1)
  mirror(redis.call('HGET', key, 'run'), id, {'webhook_state', 'pending', 'webhook_attempts', 0,
    'webhook_next_ms', now})
  return {'pending', redis.call('HGET', key, 'run')}
end

return redis.error_reply('webhooks.lua: unknown op ' .. tostring(op))
