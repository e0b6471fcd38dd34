-- Webhook deliveries (runs/webhooks.rs): the script that ends a run enqueued its event
-- (runs/hooks.lua `webhook_enqueue`); workers claim the due ones, send them and finish
-- each here. Every time is the Redis server's clock.
-- KEYS[1] due (ZSET event -> due ms), KEYS[2] leased (ZSET event -> lease deadline ms),
-- KEYS[3] dead (ZSET event -> ms it gave up). ARGV[1] the op, ARGV[2] the base the event
-- and run keys share ('<prefix>:<slot>:', keys.rs `webhook_event`, `run_record`): an
-- event's id is learned as the script meets it.
local op, base = ARGV[1], ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function event_key(id) return base .. 'wh:e:' .. id end

-- The scheme and authority of a URL: what the per-endpoint bound counts by
-- (runs/webhooks.rs `origin`, the same rule).
local function origin(url) return string.match(url or '', '^[^:/?#]+://[^/?#]*') or '' end

-- The run object's `webhook` mirrors its current event's state (one HGETALL reads a run);
-- an earlier event of a re-driven run, or a run past its retention, is left alone.
local function mirror(run_id, event, fields)
  local run = base .. 'run:' .. run_id
  if redis.call('HGET', run, 'webhook_event') == event then redis.call('HSET', run, unpack(fields)) end
end

if op == 'claim' then
  -- ARGV[3] lease ms, [4] at most this many, [5..] origins this worker sends no more
  -- to now (its per-endpoint bound). A lease past its deadline (its worker died
  -- sending) is due again first. Each claim counts an attempt: the count is the
  -- claim's fence (a finish of an older attempt is stale).
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 100)) do
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZADD', KEYS[1], now, id)
  end
  local busy = {}
  for i = 5, #ARGV do busy[ARGV[i]] = true end
  local want = tonumber(ARGV[4])
  local out = {}
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, want * 4)) do
    if #out >= want then break end
    local key = event_key(id)
    local e = redis.call('HMGET', key, 'run', 'type', 'ms', 'url', 'tenant', 'body')
    if not e[1] then
      -- Its event expired (a run long past its retention): nothing left to send.
      redis.call('ZREM', KEYS[1], id)
    elseif not busy[origin(e[4])] then
      local attempt = redis.call('HINCRBY', key, 'attempts', 1)
      redis.call('ZREM', KEYS[1], id)
      redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), id)
      redis.call('HSET', key, 'state', 'sending')
      out[#out + 1] = {id, e[1], e[2], e[3], e[4], e[5], tostring(attempt), e[6] or ''}
    end
  end
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {out, first[2] or '', tostring(now)}
end

if op == 'finish' then
  -- ARGV[3] event, [4] the attempt (its claim), [5] delivered | stopped | retry,
  -- [6] the HTTP status ('' for none), [7] what went wrong ('' for nothing), [8] ms
  -- until the next attempt ('' : none left, it goes dead), [9] the body sent (kept: every
  -- attempt sends the same), [10] how long a finished event is kept, ms.
  local id = ARGV[3]
  local key = event_key(id)
  if redis.call('HGET', key, 'attempts') ~= ARGV[4] or not redis.call('ZSCORE', KEYS[2], id) then
    return {'stale'}
  end
  redis.call('ZREM', KEYS[2], id)
  if ARGV[9] ~= '' then redis.call('HSETNX', key, 'body', ARGV[9]) end
  local state, next_ms = ARGV[5], ''
  if state == 'retry' then
    if ARGV[8] == '' then
      state = 'failed'
      redis.call('ZADD', KEYS[3], now, id)
    else
      state = 'retrying'
      next_ms = now + tonumber(ARGV[8])
      redis.call('ZADD', KEYS[1], next_ms, id)
    end
  end
  redis.call('HSET', key, 'state', state, 'last_status', ARGV[6], 'error', ARGV[7], 'next_ms', next_ms,
    'last_ms', now)
  if state ~= 'retrying' then redis.call('PEXPIRE', key, tonumber(ARGV[10])) end
  mirror(redis.call('HGET', key, 'run'), id, {'webhook_state', state, 'webhook_attempts', ARGV[4],
    'webhook_last_status', ARGV[6], 'webhook_next_ms', next_ms, 'webhook_error', ARGV[7]})
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
  -- operator fixed the receiver). Its id, body and signature scheme stay the same.
  local id = ARGV[3]
  local key = event_key(id)
  if not redis.call('ZSCORE', KEYS[3], id) or redis.call('EXISTS', key) == 0 then return {'not_dead'} end
  redis.call('ZREM', KEYS[3], id)
  redis.call('PERSIST', key)
  redis.call('HSET', key, 'attempts', 0, 'state', 'pending', 'next_ms', now)
  redis.call('ZADD', KEYS[1], now, id)
  mirror(redis.call('HGET', key, 'run'), id, {'webhook_state', 'pending', 'webhook_attempts', 0,
    'webhook_next_ms', now})
  return {'pending', redis.call('HGET', key, 'run')}
end

return redis.error_reply('webhooks.lua: unknown op ' .. tostring(op))
