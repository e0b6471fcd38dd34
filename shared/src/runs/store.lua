-- The run store's atomic operations, built on the queue's Lua library and the run
-- store's (runs/lib.lua), both prepended.
--
-- KEYS[1..Q_NKEYS] the queue's keys (see queue/lib.lua), then:
-- KEYS[Q_NKEYS+1] run record HASH    KEYS[Q_NKEYS+2] transcript LIST (JSON entries)
-- KEYS[Q_NKEYS+3] events STREAM       KEYS[Q_NKEYS+4] the tenant's run index ZSET (id -> created ms)
-- KEYS[Q_NKEYS+5] idempotency key STRING (create only; otherwise any key of the slot)
-- ARGV[1] op, ARGV[2] run id, the rest per op (below).
--
-- Every write by a worker is fenced by its lease's epoch (q_fence) in the same
-- script, and checked against the run's own state: a turn delivered twice never
-- appends twice, a stale worker never forks the run, a cancelled run's queued
-- turn never reaches the provider.

RUN, TX, EV, IDX, IDEM = KEYS[Q_NKEYS + 1], KEYS[Q_NKEYS + 2], KEYS[Q_NKEYS + 3], KEYS[Q_NKEYS + 4], KEYS[Q_NKEYS + 5]
id = ARGV[2]
local op = ARGV[1]

-- A tenant's submit rate, a GCRA (runs/quota.rs): its key, beside its unfinished runs'
-- set `active`, holds the time its submits are paid up to; a submit adds a minute's
-- share of `per_min` and is refused when that would run more than a minute ahead of
-- now (a burst of the whole minute's, then evenly). `take` books the submit.
local function create_rate(active, per_min)
  if per_min <= 0 then return {refused = true, retry_ms = 60000} end
  local key = string.sub(active, 1, #active - #'active') .. 'submits'
  local now = q_now()
  local after = math.max(tonumber(redis.call('GET', key)) or now, now) + 60000 / per_min
  if after - now > 60000 then return {refused = true, retry_ms = math.ceil(after - now - 60000)} end
  return {take = function()
    redis.call('SET', key, string.format('%.3f', after), 'PX', math.ceil(after - now) + 1000)
  end}
end

if op == 'create' then
  -- ARGV[3] tenant, [4] fingerprint ('' = no idempotency key), [5] idem ttl ms,
  -- [6] job payload, [7] record fields JSON (flat object of strings), [8] run.queued data,
  -- [9] the tenant's most unfinished runs, [10] its submits a minute (runs/quota.rs),
  -- [11..] transcript entries (JSON, stored as given: never re-encoded by Lua)
  local tenant, fp = ARGV[3], ARGV[4]
  if fp ~= '' then
    local prior = redis.call('GET', IDEM)
    local prior_id, prior_fp
    if prior then prior_id, prior_fp = string.match(prior, '^([^|]+)|(.*)$') end
    -- A key whose run is gone (its retention ran out before the key's day did) names
    -- nothing to replay: the submit creates a run, and the key names it from now on.
    if prior_id and redis.call('EXISTS', string.sub(RUN, 1, #RUN - #id) .. prior_id) == 1 then
      if prior_fp ~= fp then return {'mismatch', prior_id} end
      return {'replayed', prior_id}
    end
  end
  if redis.call('EXISTS', RUN) == 1 then return {'exists', id} end
  -- The tenant's quotas, before anything is written (a refusal writes nothing).
  local active = run_active(RUN, tenant)
  local max_active = tonumber(ARGV[9])
  if redis.call('ZCARD', active) >= max_active then
    return {'quota', string.format('the tenant has %d unfinished runs, its most (PACELINE_MAX_ACTIVE_RUNS)', max_active), '5000'}
  end
  local rate = create_rate(active, tonumber(ARGV[10]))
  if rate.refused then
    return {'quota', string.format('the tenant made its %d submits of the minute (PACELINE_SUBMITS_PER_MIN)',
      tonumber(ARGV[10])), string.format('%d', rate.retry_ms)}
  end
  local now = stamped(event('run.queued', ARGV[8]))
  local fields = cjson.decode(ARGV[7])
  local flat = {'stored_bytes', stored_after({stored_bytes = #ARGV[7]}, 11)}
  for k, v in pairs(fields) do
    flat[#flat + 1] = k
    flat[#flat + 1] = tostring(v)
  end
  redis.call('HSET', RUN, 'tenant', tenant, 'created_ms', now, 'updated_ms', now, unpack(flat))
  for i = 11, #ARGV, 500 do redis.call('RPUSH', TX, unpack(ARGV, i, math.min(i + 499, #ARGV))) end
  redis.call('ZADD', IDX, now, id)
  redis.call('ZADD', active, now, id)
  rate.take()
  if fp ~= '' then redis.call('SET', IDEM, id .. '|' .. fp, 'PX', tonumber(ARGV[5])) end
  q_add(id, ARGV[6], now, now)
  -- The run as this step wrote it is ARGV[7] with these (store.rs `create` builds it
  -- without reading it back; a worker may start its turn at once).
  return {'created', id, tostring(now)}
end

if op == 'cancel' then
  -- ARGV[3] tenant, [4] retention ms, [5] the cancel channel (keys.rs cancel_channel)
  if redis.call('HGET', RUN, 'tenant') ~= ARGV[3] then return {'not_found'} end
  local status = redis.call('HGET', RUN, 'status')
  if finished(status) then return {'conflict', status} end
  local now = q_now()
  redis.call('HSET', RUN, 'status', 'cancelled')
  retire(now, ARGV[4])
  event('run.cancelled', cjson.encode({status = 'cancelled'}))
  -- A queued turn is removed now; one in flight is stopped by its fenced commit. One
  -- that carries a pacer ask (parked in its budget's line, or released there and not
  -- started) is due now instead: the fetch that meets it has the pacer forget it (out of
  -- the line, its reservation given back), and the worker's start ends it.
  local r = q_read(id)
  local ok, job = false, nil
  if r and r.flag == 'q' then ok, job = pcall(cjson.decode, r.payload) end
  if ok and type(job) == 'table' and type(job.ask) == 'table' then
    q_schedule(id, r, now, now)
  elseif r and r.flag == 'q' then
    redis.call('ZREM', Q_DUE, id)
    redis.call('HDEL', Q_JOBS, id)
  elseif r and r.flag == 'l' and ARGV[5] then
    -- In flight: its worker aborts the call and runs no tool (worker's cancels).
    redis.call('PUBLISH', ARGV[5], id)
  end
  return {'cancelled', status}
end

if op == 'start' then
  -- ARGV[3] epoch, [4] turn, [5] attempt, [6] history depth in turns (0: all)
  local r, why = q_fence(id, ARGV[3])
  if not r then return {'stop', why} end
  return start_turn(ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6]) or 0)
end

if op == 'wait' then
  -- ARGV[3] epoch, [4] turn, [5] next job payload, [6] delay ms, [7] wait reason,
  -- [8] counter field to bump ('' none), [9] event type, [10] event data, [11] (absent:
  -- the delay) the wait the run shows: a turn parked in its budget's line is due at its
  -- safety deadline, and shows its estimate
  local counter = ARGV[8]
  local more = {'waited_ms', 'max_run_ms', 'created_ms'}
  if counter ~= '' then more[#more + 1] = counter end
  local r, f, why = fenced_lease(ARGV[3], ARGV[4], more)
  if not r then return {'stop', why} end
  local now = stamped(event(ARGV[9], ARGV[10]))
  local delay = tonumber(ARGV[6])
  local shown = tonumber(ARGV[11]) or delay
  redis.call('HSET', RUN, unpack(wait_fields({'updated_ms', now, 'epoch', ''}, f, now, shown, ARGV[7], counter)))
  local held = r.payload
  r.payload = ARGV[5]
  -- Parked by its worker's ask: released or retimed by the line since (pacer_host.lua
  -- marks the leased record), it is queued as the line left it, not as the ask said.
  if ARGV[11] then r.payload, delay = PACER_HOST.requeue(held, r.payload, delay, now) end
  r.deliveries = 0
  q_schedule(id, r, now + until_deadline(f, now, delay), now)
  return {'ok'}
end

if op == 'output' then
  -- The model's output of a turn whose tool calls are still to run: committed
  -- first, so a crash while tools run re-calls no model.
  -- ARGV[3] epoch, [4] turn, [5] usage JSON, [6] n events (the tool calls announced), then
  -- n type/data pairs, then the entries
  local tag = tonumber(ARGV[4]) + 1
  local r, f, why = fenced(ARGV[3], ARGV[4], usage_and({'phase', 'txi:' .. tag, 'stored_bytes'}))
  if not r then return {'stop', why} end
  if f.phase == 'tools' then return {'ok'} end
  local from, eid = events_from(6)
  local set = {'phase', 'tools', 'updated_ms', eid and stamped(eid) or q_now()}
  append_entries(from, tag, f, set)
  add_usage(f, set, ARGV[5])
  redis.call('HSET', RUN, unpack(set))
  return {'ok'}
end

if op == 'commit' then
  -- ARGV[3] epoch, [4] turn, [5] usage JSON,
  -- [6] next: 'continue' | 'complete' | 'fail',
  -- [7] next job payload (continue) or final text (complete) or error kind (fail),
  -- [8] error message (fail), [9] turn.completed data, [10] retention ms,
  -- [11] the model output's usage JSON ('' none), [12] how many of the events and
  -- [13] how many of the entries below are the model output's (its tool calls announced,
  -- its items): a turn whose tools answered at once commits its output here rather than
  -- in an 'output' step of its own; when that step did run (phase 'tools': the tools were
  -- slow, or this is a redelivery) they are written already and are skipped here.
  -- [14] '1': wake no worker for the next turn (this worker's process fetches next,
  -- lib.lua q_schedule), nor for the turns the settle releases; '2': only for those
  -- (the run does not go on now); the reply then ends with 'k' when any was: the
  -- process fetches once more (store.rs `commit_with_output` kicks it);
  -- [15] the next turn's wait, ms (0: due now): it asked the pacer at this commit and is
  -- owed that long, so the run waits at once, [16] its reason,
  -- [17] the counter it adds to, [18] its turn.paced data;
  -- [19] ('' none) the pacer ops this step makes itself, JSON (store.rs `CommitPacing`):
  -- {keys = the pacer's four keys, cfg = its ARGV[2..15], settle = the turn's call's
  -- settle op (made whatever the fence says: the call happened), ask = the next turn's
  -- acquire op (made only when this commit continues the run and no turn is due and
  -- untaken — else its fetch asks: below; cleared, the next turn's payload [7] says
  -- so; owed, it waits from here as [15..18] would have it)};
  -- [20] n events written before turn.completed (the output's, then the tool results),
  -- then n type/data pairs, then the entries appended
  local tag = tonumber(ARGV[4]) + 1
  PACER_HOST.quiet = ARGV[14] == '1' or ARGV[14] == '2'
  -- (Its process watches what the line's retimes move up: PACER_HOST.kicked.)
  if PACER_HOST.quiet then PACER_HOST.watch = {} end
  local delay, reason, counter, paced = tonumber(ARGV[15]) or 0, ARGV[16], ARGV[17], ARGV[18]
  local pacing = ARGV[19] ~= '' and cjson.decode(ARGV[19]) or nil
  -- The pacer's ops, in one call of its script: `ops` at the clock `now`; the answers,
  -- or nil when the pacer failed (the next turn's fetch then asks for it). A failed
  -- batch that held the call's settle marks the reply ('u', `reply` below): the
  -- caller sends that settle alone (worker pacing.rs `SettleGuard::made_by`), or the
  -- reservation would stand until it lapses, the budget held by a call long answered.
  local unsettled = false
  local function pace(ops, now)
    local replies = pacer_batch(pacing.keys, pacing.cfg, now, ops)
    if not replies and pacing.settle then unsettled = true end
    return replies
  end
  local function reply(out, now)
    if unsettled then out[#out + 1] = 'u' end
    return PACER_HOST.kicked(out, now)
  end
  local more = {'txi:' .. tag, 'phase', 'waited_ms', 'budget_waits', 'max_run_ms', 'created_ms', 'stored_bytes',
    'tenant', 'webhook_url'}
  if counter ~= '' and counter ~= 'budget_waits' then more[#more + 1] = counter end
  local r, f, why = fenced(ARGV[3], ARGV[4], usage_and(more))
  if not r then
    if pacing and pacing.settle then pace({pacing.settle}, q_now()) end
    return reply({'stop', why})
  end
  local turns = (tonumber(f.turns) or 0) + 1
  local next = ARGV[6]
  local payload = ARGV[7]
  local recorded = f.phase == 'tools'
  local n = tonumber(ARGV[20]) or 0
  local from = 21 + 2 * n + (recorded and tonumber(ARGV[13]) or 0)
  -- (On a fail, ARGV[7] and [8]; or the stored-size bound's.)
  local kind, message = ARGV[7], ARGV[8]
  -- A run whose spec and transcript, this turn's entries with them, pass RUN_MAX_BYTES
  -- ends here, its turn kept, rather than grow on (its next turn is asked for nowhere).
  if next == 'continue' and stored_after(f, from) > RUN_MAX_BYTES then
    next = 'fail'
    kind = 'run_too_large'
    message = string.format('the run stores more than %d MiB (its spec and transcript): the most one run may',
      RUN_MAX_BYTES / 1048576)
  end
  -- The next turn's ask, made here: its answer, and the clock it was made at. Not while
  -- turns are due and untaken (every worker's slots are busy): a turn cleared now would
  -- hold its reservation in the pacer while it waits for a slot, and every pacer op reads
  -- and writes every reservation held — with 600 runs for 64 slots, 3.2 ms of Redis CPU
  -- a turn, not 0.74. It asks at its fetch instead (runs/fetch.lua), when it starts.
  local asked, now, eta = nil, nil, 0
  local asking = pacing and pacing.ask and next == 'continue'
  if asking then
    now = q_now()
    asking = redis.call('ZCOUNT', Q_DUE, '-inf', now) == 0
  end
  if asking then
    -- (Its reservation, the next turn's first attempt's, was never asked for: a commit of
    -- this turn that landed before would have moved the run on, and this one be fenced.)
    local ops = {{'fresh', pacing.ask[2]}, pacing.ask}
    if pacing.settle then table.insert(ops, 1, pacing.settle) end
    local replies = pace(ops, now)
    asked = replies and replies[#ops]
    if type(asked) == 'table' and asked[1] == 0 then
      local job = cjson.decode(payload)
      job.cleared = true
      payload = cjson.encode(job)
    elseif type(asked) == 'table' and asked[1] == 1 then
      -- Parked (pacer/lua/acquire.lua `park`): its entry is due at `delay` (the line's
      -- timer, or a safety deadline: the line releases it before), the run shows its estimate.
      delay = math.max(math.floor(tonumber(asked[2]) or 0), 1)
      eta = math.max(math.floor(tonumber(asked[4]) or delay), 1)
      local code = tonumber(asked[3]) or 1
      reason, counter = (REASONS[code] or REASONS[1])[2], 'budget_waits'
      paced = paced_data(tag, eta, code)
    else
      asked = nil
    end
  end
  local skip = recorded and tonumber(ARGV[12]) or 0
  -- The step's events, one entry: the output's tool calls (unless written), the
  -- tool results, turn.completed, and the run's end when it ends here, or the
  -- next turn's wait.
  local events = argv_slice(21 + 2 * skip, 20 + 2 * n)
  events[#events + 1] = 'turn.completed'
  events[#events + 1] = ARGV[9]
  if next == 'continue' and delay > 0 then
    events[#events + 1] = 'turn.paced'
    events[#events + 1] = paced
  end
  if next == 'complete' then
    events[#events + 1] = 'run.completed'
    events[#events + 1] = cjson.encode({output_text = ARGV[7], turns = turns})
  elseif next ~= 'continue' then
    events[#events + 1] = 'run.failed'
    events[#events + 1] = cjson.encode({error = {kind = kind, message = message}, turns = turns})
  end
  local stamp = stamped(event_entry(events))
  now = now or stamp
  -- A settle with no ask is made on the event's clock (no TIME of its own).
  if pacing and pacing.settle and not asking then pace({pacing.settle}, now) end
  local set = {'turns', turns, 'phase', '', 'updated_ms', now, 'epoch', ''}
  append_entries(from, tag, f, set)
  add_usage(f, set, ARGV[5], recorded and '' or ARGV[11])
  if next == 'continue' then
    if delay > 0 then
      wait_fields(set, f, now, math.max(eta, 0) > 0 and eta or delay, reason, counter)
    else
      for _, v in ipairs({'status', 'queued', 'wait_reason', '', 'next_attempt_ms', ''}) do set[#set + 1] = v end
    end
    redis.call('HSET', RUN, unpack(set))
    r.payload = payload
    r.deliveries = 0
    q_schedule(id, r, now + (delay > 0 and until_deadline(f, now, delay) or 0), now, delay == 0 and ARGV[14] == '1')
    local out = {'continued', tostring(turns)}
    if asked then
      out[3] = tostring(asked[1]); out[4] = string.format('%d', delay); out[5] = tostring(asked[3] or 0)
      out[6] = string.format('%d', eta)
    end
    return reply(out, now)
  end
  q_finish(id)
  if next == 'complete' then
    for _, v in ipairs({'status', 'completed', 'output_text', ARGV[7]}) do set[#set + 1] = v end
    retire(now, ARGV[10], f.tenant or nil, set, f.webhook_url or false)
    return reply({'completed', tostring(turns)}, now)
  end
  for _, v in ipairs({'status', 'failed', 'error_kind', kind, 'error_message', message}) do set[#set + 1] = v end
  retire(now, ARGV[10], f.tenant or nil, set, f.webhook_url or false)
  return reply({'failed', tostring(turns)}, now)
end

if op == 'fail' then
  -- ARGV[3] epoch, [4] turn, [5] error kind, [6] message, [7] retention ms,
  -- [8] usage JSON (of a call that was answered)
  local r, f, why = fenced(ARGV[3], nil, usage_and({'webhook_url'}))
  if not r then return {'stop', why} end
  local now = stamped(event('run.failed', cjson.encode({error = {kind = ARGV[5], message = ARGV[6]}})))
  local set = {'status', 'failed', 'error_kind', ARGV[5], 'error_message', ARGV[6], 'epoch', ''}
  add_usage(f, set, ARGV[8])
  redis.call('HSET', RUN, unpack(set))
  retire(now, ARGV[7], nil, nil, f.webhook_url or false)
  q_finish(id)
  return {'failed'}
end

if op == 'retry' then
  -- Re-drives a failed run from its last committed turn (POST /v1/runs/{id}/retry),
  -- in one step: its dead turn leaves the dead set, the run is queued again
  -- (error and finish cleared, retention cancelled, back among its tenant's
  -- unfinished runs, run.queued written) and its next turn is enqueued with
  -- fresh deliveries. ARGV[3] tenant ('' = the operator: any tenant's run), ARGV[4] the
  -- tenant's most unfinished runs ('' for the operator's retry: no quota), ARGV[5] the
  -- most retries a run may have (a poison run's turn must not be re-driven without end
  -- into workers other tenants' turns share).
  -- No epoch is bumped: the turn's record goes back to 'q', which fences every
  -- earlier holder ('not_leased'), and the next fetch gives it the next epoch of its
  -- record, larger than any before it (fetch.lua `q_next_epoch`).
  local tenant = redis.call('HGET', RUN, 'tenant')
  if not tenant or (ARGV[3] ~= '' and tenant ~= ARGV[3]) then return {'not_found'} end
  local status = redis.call('HGET', RUN, 'status')
  if status ~= 'failed' then return {'conflict', status} end
  local kind = redis.call('HGET', RUN, 'error_kind') or ''
  if kind == 'max_turns' then return {'conflict', 'failed with max_turns: it has no turn left to run'} end
  if kind == 'run_too_large' then return {'conflict', 'failed with run_too_large: it stores all a run may'} end
  local retries = tonumber(redis.call('HGET', RUN, 'retries') or '0') or 0
  if retries >= tonumber(ARGV[5]) then
    return {'conflict', string.format('failed; it was retried %d times, the most a run may be', retries)}
  end
  local max_active = tonumber(ARGV[4])
  if max_active and redis.call('ZCARD', (run_active(RUN, tenant))) >= max_active then
    return {'quota', string.format('the tenant has %d unfinished runs, its most (PACELINE_MAX_ACTIVE_RUNS)', max_active), '5000'}
  end
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
  redis.call('HSET', RUN, 'status', 'queued', 'phase', phase, 'wait_reason', '', 'next_attempt_ms', '', 'updated_ms', now,
    'retries', retries + 1)
  redis.call('ZADD', (run_active(RUN, tenant)), now, id)
  event('run.queued', cjson.encode({retried = true, turn = turns, previous_error = {kind = kind, message = message}}))
  -- The next turn's payload: runs/turn.rs `TurnJob` (its test holds the shape).
  local payload = string.format('{"turn":%d,"attempt":1}', turns)
  local r = q_read(id)
  if r then
    r.payload = payload
    r.deliveries = 0
    q_schedule(id, r, now, now)
  else
    q_add(id, payload, now, now)
  end
  -- The run as this step left it (a worker may start its turn at once).
  local out = {'queued', tostring(turns)}
  for _, v in ipairs(redis.call('HGETALL', RUN)) do out[#out + 1] = v end
  return out
end

if op == 'mcp_tools' then
  -- A run's MCP tool list as the first turn to list its servers found it (ARGV[3], JSON),
  -- written by the holder of its turn's live lease (ARGV[4], its epoch: the record's
  -- `epoch` names it, `fenced`): kept once, so every later turn on any worker offers the
  -- model the same tools; answers the list kept (another holder's, if it was first).
  local f = read_fields({'tenant', 'epoch', 'mcp_tools'})
  if not f.tenant or f.epoch ~= ARGV[4] then return {'stop'} end
  if f.mcp_tools then return {'ok', f.mcp_tools} end
  redis.call('HSET', RUN, 'mcp_tools', ARGV[3])
  return {'ok', ARGV[3]}
end

return redis.error_reply('unknown run store op ' .. tostring(op))
