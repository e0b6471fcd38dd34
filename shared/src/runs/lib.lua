-- The run store's Lua library: the run's helpers and a turn's start, on the queue's
-- library (prepended before it). Prepended to store.lua, whose ops run on one run's
-- keys (KEYS), and to the run store's fetch (store.rs `fetch_script`), which starts
-- each turn it leases: RUN, TX, EV and id name the run a function works on; the
-- script that uses them sets them first.
-- EV_MAXLEN (the events stream's length) is prepended by store.rs.

local RUN, TX, EV, IDX, IDEM, id

-- Events one stream entry holds at most (event_entry).
local EVENTS_PER_ENTRY = 500

-- ARGV[from..to] as a table, copied (not unpacked: a slice may be longer than unpack holds).
local function argv_slice(from, to)
  local out = {}
  for i = from, to do out[#out + 1] = ARGV[i] end
  return out
end

local function event(kind, data)
  return redis.call('XADD', EV, 'MAXLEN', '~', EV_MAXLEN, '*', 'type', kind, 'data', data)
end

-- Writes the events `list` (type, data, type, data, …) as one entry of the stream:
-- `type`/`data`, then `type1`/`data1`, … (store.rs `RunEvent::from_entry` reads them
-- back as events of their own). A step's events cost one XADD, not one each.
-- Returns the entry's id (nil: no events).
local function event_entry(list)
  if #list == 0 then return nil end
  -- At most EVENTS_PER_ENTRY events an entry (Lua's unpack holds ~8 000 values: a turn
  -- of thousands of tool calls is several entries, written in this same script).
  local id
  for from = 1, #list, 2 * EVENTS_PER_ENTRY do
    local args = {'XADD', EV, 'MAXLEN', '~', EV_MAXLEN, '*'}
    for i = from, math.min(from + 2 * EVENTS_PER_ENTRY - 1, #list), 2 do
      local k = (i - from) / 2
      local suffix = k == 0 and '' or tostring(k)
      args[#args + 1] = 'type' .. suffix
      args[#args + 1] = list[i]
      args[#args + 1] = 'data' .. suffix
      args[#args + 1] = list[i + 1]
    end
    id = redis.call(unpack(args))
  end
  return id
end

-- The Redis server's clock in ms, read off the id of an event just written: XADD
-- stamps an entry with the server's clock (never earlier than the stream's last
-- entry), so a step that writes an event needs no TIME of its own.
local function stamped(event_id)
  return tonumber(string.match(event_id, '^(%d+)'))
end

local finished = run_finished

-- The record's usage counters a call adds to (record.rs `field`).
local USAGE_FIELDS = {'input_tokens', 'output_tokens', 'reasoning_tokens', 'cached_input_tokens',
  'cache_write_tokens'}

-- Adds calls' usage (JSON objects of those counters; missing ones are 0; ''
-- none) to the record's counters as read in `f`: the new values go into `set`,
-- the field/value pairs of the script's one HSET (one write, not one per counter).
local function add_usage(f, set, ...)
  local us = {}
  for _, json in ipairs({...}) do
    if json ~= '' then us[#us + 1] = cjson.decode(json) end
  end
  for _, k in ipairs(USAGE_FIELDS) do
    local add = 0
    for _, u in ipairs(us) do add = add + math.floor(tonumber(u[k]) or 0) end
    if add ~= 0 then
      set[#set + 1] = k
      set[#set + 1] = string.format('%d', (tonumber(f[k]) or 0) + add)
    end
  end
end

-- A record's HGETALL (flat: field, value, …) by field name.
local function record_of(fields)
  local f = {}
  for i = 1, #fields, 2 do f[fields[i]] = fields[i + 1] end
  return f
end

-- The record's fields `names`, read in one HMGET, by name (false: missing).
local function read_fields(names)
  local vals = redis.call('HMGET', RUN, unpack(names))
  local f = {}
  for i, n in ipairs(names) do f[n] = vals[i] end
  return f
end

-- Appends to `set` the fields of a run put to wait `delay` ms from `now` for `reason`:
-- its status, reason and next attempt, its waited time (from `f.waited_ms`) and, unless
-- `counter` is '', that counter (from `f[counter]`) plus one. Every wait writes these:
-- store.lua's `wait` and `commit`, and the fetch that asks the pacer (fetch.lua).
local function wait_fields(set, f, now, delay, reason, counter)
  for _, v in ipairs({'status', 'waiting', 'wait_reason', reason, 'next_attempt_ms', now + delay,
    'waited_ms', string.format('%d', (tonumber(f.waited_ms) or 0) + delay)}) do set[#set + 1] = v end
  if counter ~= '' then
    set[#set + 1] = counter
    set[#set + 1] = string.format('%d', (tonumber(f[counter]) or 0) + 1)
  end
  return set
end

-- The pacer's reasons (pacer/lua/model.lua `owed`: 1 budget, 2 rate_limited, 3 probe, 4 fair_share) as
-- the worker's wait names them (turn.rs `budget_wait_record`): the event's, the run's.
local REASONS = {{'budget', 'budget'}, {'window_closed', 'budget'}, {'probe', 'budget'}, {'fair_share', 'fair_share'}}

-- The `turn.paced` data of turn `turn` owed `ms` for reason `code` (the pacer's).
local function paced_data(turn, ms, code)
  return cjson.encode({turn = turn, owed_ms = ms, reason = (REASONS[code] or REASONS[1])[1]})
end

-- The most bytes one run may store, its spec and transcript (field stored_bytes): a
-- commit that takes it past fails the run (`run_too_large`), its last turn kept, so a
-- run holds at most this and one turn (whose tool answers are bounded on their own).
local RUN_MAX_BYTES = 32 * 1024 * 1024

-- What run `f` stores once ARGV[from..] are appended to its transcript.
local function stored_after(f, from)
  local n = tonumber(f.stored_bytes) or 0
  for i = from, #ARGV do n = n + #ARGV[i] end
  return n
end

-- Appends transcript entries ARGV[from..] in one RPUSH per 500, and puts where
-- turn `tag`'s entries begin (field txi:<tag>, see window_entries) and what the run
-- stores then in `set` (`f` holds txi:<tag> and stored_bytes).
local function append_entries(from, tag, f, set)
  local len
  for i = from, #ARGV, 500 do
    len = redis.call('RPUSH', TX, unpack(ARGV, i, math.min(i + 499, #ARGV)))
  end
  local field = 'txi:' .. tag
  if len and not f[field] then
    set[#set + 1] = field
    set[#set + 1] = len - (#ARGV - from + 1)
  end
  if len then
    set[#set + 1] = 'stored_bytes'
    set[#set + 1] = stored_after(f, from)
  end
end

-- Writes the events ARGV[at+1 ..] (ARGV[at]: how many; each a type and its data), as
-- one entry, and returns where the arguments after them begin, and the entry's id (nil: none): the events a step announces are
-- written by its own fenced script (a stale holder writes none, a retried step none twice).
local function events_from(at)
  local n = tonumber(ARGV[at]) or 0
  return at + 1 + 2 * n, event_entry(argv_slice(at + 1, at + 2 * n))
end

-- A finished run's keys live for the retention period, then go.
local function retire(now, retention, tenant, set, webhook)
  run_retire(RUN, TX, EV, now, retention, tenant, set, webhook)
end

-- Checks the run as read in `f` (its status and turns) for turn `turn`
-- (nil: any): nil when this turn is not to go on, and why.
local function check_run(f, turn)
  local status = f.status
  if not status then
    q_finish(id)
    return 'gone'
  end
  if finished(status) then
    -- Cancelled (or finished) while this turn was out: it ends here.
    q_finish(id)
    return status
  end
  if turn and tonumber(f.turns or '0') ~= tonumber(turn) then
    -- This turn was already committed (a redelivery): write nothing.
    return 'committed'
  end
  return nil
end

-- Checks the lease and the run, reading the record's status, turns and the
-- fields `more` in one HMGET: the queue record and those fields by name, or
-- nil, nil and why not. For a holder that may not have started its turn (a
-- budget wait before the start: `wait`).
local function fenced_lease(epoch, turn, more)
  local r, why = q_fence(id, epoch)
  if not r then return nil, nil, why end
  local names = {'status', 'turns'}
  for _, n in ipairs(more or {}) do names[#names + 1] = n end
  local f = read_fields(names)
  why = check_run(f, turn)
  if why then return nil, nil, why end
  return r, f
end

-- `fenced_lease` for a holder that started its turn (output, commit, fail), off the
-- run's record alone: its `epoch` field names the lease whose start it saw, and is
-- cleared by whatever ends that lease — the run's own steps (wait, commit, fail,
-- a bury, runs/hooks.lua) in the HSET they write anyway, the queue's (a reclaim, a settle) by
-- `Q_HOOKS.lease_ended` — so it equals `epoch` exactly while that lease is live (the queue's
-- record is not read: one command a step less). Returns the queue record as the
-- holder's lease left it (epoch, no deliveries, leased; the caller sets the payload
-- it writes), and the fields.
local function fenced(epoch, turn, more)
  local names = {'status', 'turns', 'epoch'}
  for _, n in ipairs(more or {}) do names[#names + 1] = n end
  local f = read_fields(names)
  if f.status and f.epoch ~= epoch then return nil, nil, 'stale' end
  local why = check_run(f, turn)
  if why then return nil, nil, why end
  return {epoch = tonumber(epoch), deliveries = 0, flag = 'l', payload = ''}, f
end

-- The fields a call's usage adds to, for `fenced`'s `more`, with `extra`.
local function usage_and(extra)
  local out = {}
  for _, k in ipairs(USAGE_FIELDS) do out[#out + 1] = k end
  for _, k in ipairs(extra) do out[#out + 1] = k end
  return out
end

-- (Where turn `tag`'s transcript entries begin is field txi:<tag> of the
-- record, set at its first append by append_entries, so a turn's start reads
-- only the history the model will see, not the whole transcript: a long run
-- copied it all at every turn.)

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

-- Whether the run whose fields `f` holds (max_run_ms, created_ms) is past its deadline
-- (max_run_seconds) at `now`.
local function past_deadline(f, now)
  local max_run = tonumber(f.max_run_ms or '')
  return max_run ~= nil and now >= (tonumber(f.created_ms) or now) + max_run
end

-- A waiting turn's delay (ms from `now`), no later than its run's deadline (`f` as
-- above; at least 1 ms): a turn waiting for budget, a 429 or a retry is started — and so
-- failed — when its run's time is up, not when its wait ends (a parked turn's safety
-- deadline may be hours out).
local function until_deadline(f, now, delay)
  local max_run = tonumber(f.max_run_ms or '')
  if not max_run then return delay end
  return math.max(math.min(delay, (tonumber(f.created_ms) or now) + max_run - now), 1)
end

-- Starts turn `turn` (attempt `attempt`) of run `id` for the lease at `epoch`, whose
-- fence the caller checked: marks the run running (turn.started), or fails it past its
-- deadline, and reads what the turn needs with a history of `max_hist` turns (0: all).
-- Returns {'stop', why} or {'ok', n, n transcript entries, the record's field/value
-- pairs} (appended, not unpacked: a long transcript would overflow Lua's stack). The
-- pairs are as read before this HSET: the worker needs the run's spec and counters,
-- not its status. Epoch, turn and attempt are strings (as ARGV carries them).
local function start_turn(epoch, turn, attempt, max_hist, read)
  -- The whole record is what the turn needs anyway: read once, checked from it (`read`:
  -- as this script read it already, HGETALL's flat list).
  local fields = read or redis.call('HGETALL', RUN)
  local f = record_of(fields)
  local why = check_run(f, turn)
  if why then return {'stop', why} end
  local status = f.status
  local now
  -- A run past its wall-clock deadline (max_run_seconds) fails here, before any call.
  local max_run = tonumber(f.max_run_ms or '')
  if max_run then now = q_now() end
  if max_run and past_deadline(f, now) then
    local message = 'the run passed its max_run_seconds (' .. math.floor(max_run / 1000) .. ' s)'
    redis.call('HSET', RUN, 'status', 'failed', 'error_kind', 'deadline', 'error_message', message, 'updated_ms', now)
    retire(now, redis.call('HGET', RUN, 'retention_ms'), nil, nil, f.webhook_url or false)
    event('run.failed', cjson.encode({error = {kind = 'deadline', message = message}}))
    q_finish(id)
    return {'stop', 'deadline'}
  end
  -- Every delivery that starts says so with its epoch, a redelivery of a
  -- running turn too; its deltas and tool events carry the same epoch, so a
  -- listener can drop what a stale holder wrote in the moment before it stopped.
  if status ~= 'running' or f.epoch ~= epoch then
    -- (Written out, not cjson's: an epoch may pass cjson's 14 digits.)
    local eid = event('turn.started', string.format('{"turn":%d,"attempt":%d,"epoch":%s}', tonumber(turn),
      tonumber(attempt), epoch))
    now = now or stamped(eid)
  end
  now = now or q_now()
  redis.call('HSET', RUN, 'status', 'running', 'updated_ms', now, 'wait_reason', '', 'next_attempt_ms', '',
    'epoch', epoch)
  local tx = window_entries(fields, max_hist)
  local out = {'ok', tostring(#tx)}
  for i = 1, #tx do out[#out + 1] = tx[i] end
  for _, v in ipairs(fields) do out[#out + 1] = v end
  return out
end
