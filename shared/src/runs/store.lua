-- The run store's atomic operations, built on the queue's Lua library (prepended).
--
-- KEYS[1..6] the queue's keys (see queue/lib.lua), then:
-- KEYS[7] run record HASH    KEYS[8] transcript LIST (JSON entries)
-- KEYS[9] events STREAM       KEYS[10] the tenant's run index ZSET (id -> created ms)
-- KEYS[11] idempotency key STRING (create only; otherwise any key of the slot)
-- ARGV[1] op, ARGV[2] run id, the rest per op (below).
--
-- Every write by a worker is fenced by its lease's epoch (q_fence) in the same
-- script, and checked against the run's own state: a turn delivered twice never
-- appends twice, a stale worker never forks the run, a cancelled run's queued
-- turn never reaches the provider.

local RUN, TX, EV, IDX, IDEM = KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]
local op, id = ARGV[1], ARGV[2]
-- EV_MAXLEN (the events stream's length) is prepended by store.rs.

local function event(kind, data)
  return redis.call('XADD', EV, 'MAXLEN', '~', EV_MAXLEN, '*', 'type', kind, 'data', data)
end

local finished = q_run_finished

-- The record's usage counters a call adds to (record.rs `field`).
local USAGE_FIELDS = {'input_tokens', 'output_tokens', 'reasoning_tokens', 'cached_input_tokens'}

-- Adds one call's usage: a JSON object of those counters (missing ones are 0).
local function add_usage(json)
  local u = cjson.decode(json)
  for _, f in ipairs(USAGE_FIELDS) do
    redis.call('HINCRBY', RUN, f, math.floor(tonumber(u[f]) or 0))
  end
end

-- A finished run's keys live for the retention period, then go.
local function retire(now, retention) q_run_retire(RUN, TX, EV, now, retention) end

-- Checks the lease and the run: the record fields, or nil and why not.
local function fenced(epoch, turn)
  local r, why = q_fence(id, epoch)
  if not r then return nil, nil, why end
  local status = redis.call('HGET', RUN, 'status')
  if not status then
    q_finish(id)
    return nil, nil, 'gone'
  end
  if finished(status) then
    -- Cancelled (or finished) while this turn was out: it ends here.
    q_finish(id)
    return nil, nil, status
  end
  if turn and tonumber(redis.call('HGET', RUN, 'turns') or '0') ~= tonumber(turn) then
    -- This turn was already committed (a redelivery): write nothing.
    return nil, nil, 'committed'
  end
  return r, status
end

if op == 'create' then
  -- ARGV[3] tenant, [4] fingerprint ('' = no idempotency key), [5] idem ttl ms,
  -- [6] job payload, [7] record fields JSON (flat object of strings), [8] run.queued data,
  -- [9..] transcript entries (JSON, stored as given: never re-encoded by Lua)
  local tenant, fp = ARGV[3], ARGV[4]
  if fp ~= '' then
    local prior = redis.call('GET', IDEM)
    if prior then
      local prior_id, prior_fp = string.match(prior, '^([^|]+)|(.*)$')
      if prior_fp ~= fp then return {'mismatch', prior_id} end
      return {'replayed', prior_id}
    end
  end
  if redis.call('EXISTS', RUN) == 1 then return {'exists', id} end
  local now = q_now()
  local fields = cjson.decode(ARGV[7])
  local flat = {}
  for k, v in pairs(fields) do
    flat[#flat + 1] = k
    flat[#flat + 1] = tostring(v)
  end
  redis.call('HSET', RUN, 'tenant', tenant, 'created_ms', now, 'updated_ms', now, unpack(flat))
  for i = 9, #ARGV do redis.call('RPUSH', TX, ARGV[i]) end
  event('run.queued', ARGV[8])
  redis.call('ZADD', IDX, now, id)
  redis.call('ZADD', (q_run_active(RUN, tenant)), now, id)
  if fp ~= '' then redis.call('SET', IDEM, id .. '|' .. fp, 'PX', tonumber(ARGV[5])) end
  q_add(id, ARGV[6], now)
  return {'created', id}
end

if op == 'cancel' then
  -- ARGV[3] tenant, [4] retention ms
  if redis.call('HGET', RUN, 'tenant') ~= ARGV[3] then return {'not_found'} end
  local status = redis.call('HGET', RUN, 'status')
  if finished(status) then return {'conflict', status} end
  local now = q_now()
  redis.call('HSET', RUN, 'status', 'cancelled')
  retire(now, ARGV[4])
  event('run.cancelled', cjson.encode({status = 'cancelled'}))
  -- A queued turn is removed now; one in flight is stopped by its fenced commit.
  local r = q_read(id)
  if r and r.flag == 'q' then
    redis.call('ZREM', Q_DUE, id)
    redis.call('HDEL', Q_JOBS, id)
  end
  return {'cancelled', status}
end

-- Where turn `tag`'s transcript entries begin (field txi:<tag> of the record,
-- set at its first append), so a turn's start reads only the history the model
-- will see, not the whole transcript (a long run copied it all at every turn).
local function mark_turn_start(tag, n)
  if n > 0 then redis.call('HSETNX', RUN, 'txi:' .. tag, redis.call('LLEN', TX)) end
end

-- The transcript entries a turn needs with a history of `max_hist` turns (0: all):
-- turn 0's (the task), and every turn from the one before the window on
-- (runs/backpressure.rs, bound_history: an output in the window keeps its call
-- from the turn before). `fields` is the record's HGETALL.
local function window_entries(fields, max_hist)
  if max_hist > 0 then
    local tags, idx = {}, {}
    for i = 1, #fields, 2 do
      local t = string.match(fields[i], '^txi:(%d+)$')
      if t then
        t = tonumber(t)
        tags[#tags + 1] = t
        idx[t] = tonumber(fields[i + 1])
      end
    end
    table.sort(tags)
    if #tags > max_hist + 1 then
      -- (A turn with no index, from before this was kept, falls in the head.)
      local out = {}
      local head_end = idx[tags[1]] - 1
      if head_end >= 0 then
        for _, v in ipairs(redis.call('LRANGE', TX, 0, head_end)) do out[#out + 1] = v end
      end
      for _, v in ipairs(redis.call('LRANGE', TX, idx[tags[#tags - max_hist]], -1)) do out[#out + 1] = v end
      return out
    end
  end
  return redis.call('LRANGE', TX, 0, -1)
end

if op == 'start' then
  -- ARGV[3] epoch, [4] turn, [5] attempt, [6] history depth in turns (0: all)
  local r, status, why = fenced(ARGV[3], ARGV[4])
  if not r then return {'stop', why} end
  local now = q_now()
  -- A run past its wall-clock deadline (max_run_seconds) fails here, before any call.
  local max_run = tonumber(redis.call('HGET', RUN, 'max_run_ms') or '')
  if max_run and now >= (tonumber(redis.call('HGET', RUN, 'created_ms')) or now) + max_run then
    local message = 'the run passed its max_run_seconds (' .. math.floor(max_run / 1000) .. ' s)'
    redis.call('HSET', RUN, 'status', 'failed', 'error_kind', 'deadline', 'error_message', message, 'updated_ms', now)
    retire(now, redis.call('HGET', RUN, 'retention_ms'))
    event('run.failed', cjson.encode({error = {kind = 'deadline', message = message}}))
    q_finish(id)
    return {'stop', 'deadline'}
  end
  redis.call('HSET', RUN, 'status', 'running', 'updated_ms', now, 'wait_reason', '', 'next_attempt_ms', '')
  if status ~= 'running' then
    event('turn.started', cjson.encode({turn = tonumber(ARGV[4]), attempt = tonumber(ARGV[5])}))
  end
  -- What the turn needs, in the same step: {'ok', n, n transcript entries,
  -- the record's field/value pairs} (appended, not unpacked: a long
  -- transcript would overflow Lua's stack).
  local fields = redis.call('HGETALL', RUN)
  local tx = window_entries(fields, tonumber(ARGV[6]) or 0)
  local out = {'ok', tostring(#tx)}
  for i = 1, #tx do out[#out + 1] = tx[i] end
  for _, v in ipairs(fields) do out[#out + 1] = v end
  return out
end

if op == 'wait' then
  -- ARGV[3] epoch, [4] turn, [5] next job payload, [6] delay ms, [7] wait reason,
  -- [8] counter field to bump ('' none), [9] event type, [10] event data
  local r, status, why = fenced(ARGV[3], ARGV[4])
  if not r then return {'stop', why} end
  local now = q_now()
  local delay = tonumber(ARGV[6])
  redis.call('HSET', RUN, 'status', 'waiting', 'wait_reason', ARGV[7], 'next_attempt_ms', now + delay, 'updated_ms', now)
  redis.call('HINCRBY', RUN, 'waited_ms', delay)
  if ARGV[8] ~= '' then redis.call('HINCRBY', RUN, ARGV[8], 1) end
  event(ARGV[9], ARGV[10])
  r.payload = ARGV[5]
  r.deliveries = 0
  q_schedule(id, r, now + delay)
  return {'ok'}
end

if op == 'output' then
  -- The model's output of a turn whose tool calls are still to run: committed
  -- first, so a crash while tools run re-calls no model.
  -- ARGV[3] epoch, [4] turn, [5] usage JSON, [6..] entries
  local r, status, why = fenced(ARGV[3], ARGV[4])
  if not r then return {'stop', why} end
  if redis.call('HGET', RUN, 'phase') == 'tools' then return {'ok'} end
  mark_turn_start(tonumber(ARGV[4]) + 1, #ARGV - 5)
  for i = 6, #ARGV do redis.call('RPUSH', TX, ARGV[i]) end
  add_usage(ARGV[5])
  redis.call('HSET', RUN, 'phase', 'tools', 'updated_ms', q_now())
  return {'ok'}
end

if op == 'commit' then
  -- ARGV[3] epoch, [4] turn, [5] usage JSON,
  -- [6] next: 'continue' | 'complete' | 'fail',
  -- [7] next job payload (continue) or final text (complete) or error kind (fail),
  -- [8] error message (fail), [9] turn.completed data, [10] retention ms,
  -- [11..] entries appended
  local r, status, why = fenced(ARGV[3], ARGV[4])
  if not r then return {'stop', why} end
  local now = q_now()
  mark_turn_start(tonumber(ARGV[4]) + 1, #ARGV - 10)
  for i = 11, #ARGV do redis.call('RPUSH', TX, ARGV[i]) end
  add_usage(ARGV[5])
  local turns = redis.call('HINCRBY', RUN, 'turns', 1)
  redis.call('HSET', RUN, 'phase', '', 'updated_ms', now)
  event('turn.completed', ARGV[9])
  local next = ARGV[6]
  if next == 'continue' then
    redis.call('HSET', RUN, 'status', 'queued', 'wait_reason', '', 'next_attempt_ms', '')
    r.payload = ARGV[7]
    r.deliveries = 0
    q_schedule(id, r, now)
    return {'continued', tostring(turns)}
  end
  q_finish(id)
  if next == 'complete' then
    redis.call('HSET', RUN, 'status', 'completed', 'output_text', ARGV[7])
    retire(now, ARGV[10])
    event('run.completed', cjson.encode({output_text = ARGV[7], turns = turns}))
    return {'completed', tostring(turns)}
  end
  redis.call('HSET', RUN, 'status', 'failed', 'error_kind', ARGV[7], 'error_message', ARGV[8])
  retire(now, ARGV[10])
  event('run.failed', cjson.encode({error = {kind = ARGV[7], message = ARGV[8]}, turns = turns}))
  return {'failed', tostring(turns)}
end

if op == 'fail' then
  -- ARGV[3] epoch, [4] turn, [5] error kind, [6] message, [7] retention ms,
  -- [8] usage JSON (of a call that was answered)
  local r, status, why = fenced(ARGV[3], nil)
  if not r then return {'stop', why} end
  local now = q_now()
  add_usage(ARGV[8])
  redis.call('HSET', RUN, 'status', 'failed', 'error_kind', ARGV[5], 'error_message', ARGV[6])
  retire(now, ARGV[7])
  event('run.failed', cjson.encode({error = {kind = ARGV[5], message = ARGV[6]}}))
  q_finish(id)
  return {'failed'}
end

if op == 'retry' then
  -- Re-drives a failed run from its last committed turn (POST /v1/runs/{id}/retry),
  -- in one step: its dead turn leaves the dead set, the run is queued again
  -- (error and finish cleared, retention cancelled, back among its tenant's
  -- unfinished runs, run.queued written) and its next turn is enqueued with
  -- fresh deliveries. ARGV[3] tenant ('' = the operator: any tenant's run).
  -- No epoch is bumped: the turn's record goes back to 'q', which fences every
  -- earlier holder ('not_leased'), and the next fetch draws a new epoch from
  -- the counter, larger than any before it.
  local tenant = redis.call('HGET', RUN, 'tenant')
  if not tenant or (ARGV[3] ~= '' and tenant ~= ARGV[3]) then return {'not_found'} end
  local status = redis.call('HGET', RUN, 'status')
  if status ~= 'failed' then return {'conflict', status} end
  local kind = redis.call('HGET', RUN, 'error_kind') or ''
  if kind == 'max_turns' then return {'conflict', 'failed with max_turns: it has no turn left to run'} end
  local message = redis.call('HGET', RUN, 'error_message') or ''
  local now = q_now()
  local turns = tonumber(redis.call('HGET', RUN, 'turns') or '0') or 0
  redis.call('ZREM', Q_DEAD, id)
  redis.call('HDEL', Q_REASONS, id)
  -- A turn whose model output was committed before its tools ran (entries of
  -- the next turn at the transcript's end) resumes at its tools, as after a crash.
  local phase = ''
  local last = redis.call('LINDEX', TX, -1)
  if last then
    local ok, entry = pcall(cjson.decode, last)
    if ok and type(entry) == 'table' and tonumber(entry.turn) == turns + 1 then phase = 'tools' end
  end
  redis.call('PERSIST', RUN)
  redis.call('PERSIST', TX)
  redis.call('PERSIST', EV)
  redis.call('HDEL', RUN, 'error_kind', 'error_message', 'finished_ms')
  redis.call('HSET', RUN, 'status', 'queued', 'phase', phase, 'wait_reason', '', 'next_attempt_ms', '', 'updated_ms', now)
  redis.call('ZADD', (q_run_active(RUN, tenant)), now, id)
  event('run.queued', cjson.encode({retried = true, turn = turns, previous_error = {kind = kind, message = message}}))
  -- The next turn's payload: runs/store.rs `TurnJob` (its test holds the shape).
  local payload = string.format('{"turn":%d,"attempt":1}', turns)
  local r = q_read(id)
  if r then
    r.payload = payload
    r.deliveries = 0
    q_schedule(id, r, now)
  else
    q_add(id, payload, now)
  end
  return {'queued', tostring(turns)}
end

return redis.error_reply('unknown run store op ' .. tostring(op))
