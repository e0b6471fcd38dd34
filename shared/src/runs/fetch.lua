-- The run store's fetch (store.rs `RunStore::fetch_script`), on the queue's library,
-- the run store's (runs/hooks.lua, runs/pacer_host.lua, runs/lib.lua), the pacer's script
-- as a function (pacer/shared_pacer.rs `lua_function`) and the queue's fetch (queue/fetch.lua), prepended:
-- each turn it leases is started in the same script, unless its payload carries a pacer
-- ask it has to make first (not one cleared already: runs/turn.rs `Turn::cleared`) or a
-- format this version does not read (the worker buries it).
-- A turn that carries an ask not made yet — a run's first turn (its ask made at submit,
-- runs/pacing.rs `FirstAsk`), a turn parked in its budget's line whose entry came due
-- (the line's head at its timer, or a safety deadline) — whose pacer this fetch may ask
-- (ARGV[8]) is asked for here, before it is leased: cleared, it is leased and started as
-- a cleared turn; still owed, it stays parked in the queue, due when the pacer says (the
-- run `waiting`: wait_again), and no worker sees it — unless it is owed no longer than
-- the worker's in-place wait: then it is leased (not started: it may be owed again
-- after) with that pause (`pause_ms` in its payload), to wait in its worker as the
-- worker's own ask would have, and ask again there. A turn so owed for the probe (a
-- budget with no headers yet, a cold start: nearly every first turn) is started here
-- too: the probe's answer clears the turns that waited for it. A turn whose run ended
-- while it waited leaves its budget's line here (the pacer's `forget`). A turn the
-- line released is cleared in its payload already (`released`): asked for here too, the
-- pacer notes that its worker has it (pacer release.rs `start`: its call may reach the
-- provider from now on), and it is started as any.
-- ARGV[1..5] the queue's fetch's; ARGV[6] the history depth in turns (0: all); ARGV[7]
-- the payload format this version reads; ARGV[8] ('' none) the pacers to ask, JSON
-- (runs/pacing.rs `FetchAsks`): {routes = {provider = {keys = the pacer's keys without
-- the model, cfg = its ARGV[2..]}}, first = the provider of an ask that names none,
-- weights = {tenant = w}, caps = {tenant = c}, in_place_ms = the worker's in-place
-- wait, unpaced = the providers its worker paces not at all}. A run's keys are named
-- from its id, beside the queue's dead set, as keys.rs builds them (the queue's slot;
-- runs/hooks.lua does the same). The pacer's keys are in their budget's slot: on Redis
-- Cluster, a fetch that asks needs them on the queue's node (ARCHITECTURE.md, "Keys
-- and slots").
local max_hist, format = tonumber(ARGV[6]) or 0, tonumber(ARGV[7]) or 1
-- Decoded only when a due turn carries an ask (most fetches lease none that do).
local asks_json, asks = ARGV[8] or '', nil
local in_place = 0
local base = RUN_BASE

local function job_of(r)
  local ok, job = pcall(cjson.decode, r.payload)
  if not ok or type(job) ~= 'table' or type(job.turn) ~= 'number' or (tonumber(job.v) or 1) > format then
    return nil
  end
  return job
end

-- Whether the ask of `job` is one no worker makes (its provider paces nothing: ARGV[8]'s
-- `unpaced`): such a turn starts as any.
local function unpaced(job)
  if asks_json == '' or type(job.ask) ~= 'table' then return false end
  if not asks then asks = cjson.decode(asks_json) end
  local p = tostring(job.ask.provider or asks.first)
  for _, name in ipairs(asks.unpaced or {}) do
    if name == p then return true end
  end
  return false
end

local function start_leased(qid, r)
  -- (`hold` keeps the job it decoded on the record: q_encode writes only its own fields.)
  local job = r.job or job_of(r)
  if not job or (job.ask ~= nil and not job.cleared and not r.paused and not unpaced(job)) then return nil end
  RUN, TX, EV, id = base .. 'run:' .. qid, base .. 'tx:' .. qid, base .. 'ev:' .. qid, qid
  return start_turn(string.format('%d', r.epoch), string.format('%d', job.turn), string.format('%d', tonumber(job.attempt) or 1), max_hist,
    r.run_read)
end

-- The jitter's uniform number, from the reservation and the clock (a script has no
-- randomness of its own that differs between calls).
local function jitter_u(rid, now)
  local h = now % 65521
  for c = 1, #rid do h = (h * 31 + string.byte(rid, c)) % 65521 end
  return h / 65521
end

-- A turn still owed: the run waits, as store.lua's `wait` leaves it — the first time it
-- is owed since it last ran (one `turn.paced`, one budget wait counted, its estimate as
-- its waited time); a turn that waits on (the head's timer, a safety deadline) shows its
-- new estimate, in its waited time too (the old estimate's rest replaced by the new), and
-- says so in an event only when the estimate moved by more than a quarter (and 5 s). `a`
-- is the pacer's answer {1, due_ms, reason, eta_ms}.
local function wait_again(it, a, now)
  local code, eta = tonumber(a[3]) or 1, math.max(math.floor(tonumber(a[4]) or tonumber(a[2]) or 0), 1)
  local names = REASONS[code] or REASONS[1]
  RUN, EV = base .. 'run:' .. it.qid, base .. 'ev:' .. it.qid
  local f = it.f
  if f.status == 'waiting' and f.wait_reason == names[2] then
    local was = (tonumber(f.next_attempt_ms) or now) - now
    if math.abs(eta - was) > math.max(5000, 0.25 * math.max(eta, was)) then
      event('turn.paced', paced_data(it.job.turn, eta, code))
    end
    local waited = math.max((tonumber(f.waited_ms) or 0) - math.max(was, 0) + eta, 0)
    redis.call('HSET', RUN, 'next_attempt_ms', now + eta, 'waited_ms', string.format('%d', waited))
    return
  end
  event('turn.paced', paced_data(it.job.turn, eta, code))
  redis.call('HSET', RUN, unpack(wait_fields({'updated_ms', now}, f, now, eta, names[2], 'budget_waits')))
end

local function hold(ids, recs, now)
  local keep, watch = {}, {}
  if asks_json == '' then return keep, watch end
  local groups, order = {}, {}
  for i, qid in ipairs(ids) do
    local r = recs[i]
    local job = r and r.flag == 'q' and job_of(r)
    if job then r.job = job end
    -- (A turn the line released is asked for too: its fetch starts it, pacer release.rs.)
    local ask = job and (not job.cleared or job.released) and job.ask
    if type(ask) == 'table' and not asks then
      asks = cjson.decode(asks_json)
      in_place = tonumber(asks.in_place_ms) or 0
    end
    local route = type(ask) == 'table' and type(ask.model) == 'string' and asks.routes[ask.provider or asks.first]
    if type(route) == 'table' then
      -- Only a run whose next turn is this very one, waiting or queued, is asked for;
      -- one that ended while its turn waited has it leave its budget's line, and the
      -- worker's start ends it. (Read whole: a turn cleared here is started from this
      -- read, `start_leased`.)
      RUN = base .. 'run:' .. qid
      local read = redis.call('HGETALL', RUN)
      local f = record_of(read)
      r.run_read = read
      local gk = tostring(ask.provider or asks.first) .. '\n' .. ask.model
      local g = groups[gk]
      if not g then
        g = {route = route, model = ask.model, items = {}, gone = {}}
        groups[gk] = g
        order[#order + 1] = gk
      end
      local rid = string.format('%s:%d:%d', qid, job.turn, tonumber(job.attempt) or 1)
      -- (A run past its deadline leaves the line too: its worker's start fails it.)
      if (f.status == 'waiting' or f.status == 'queued') and tonumber(f.turns or '') == job.turn
        and not past_deadline(f, now) then
        g.items[#g.items + 1] = {qid = qid, r = r, job = job, f = f, rid = rid}
      else
        g.gone[#g.gone + 1] = rid
      end
    end
  end
  for _, gk in ipairs(order) do
    local g = groups[gk]
    local keys = {}
    for k = 1, #g.route.keys do keys[k] = g.route.keys[k] .. g.model end
    local ops = {}
    for _, rid in ipairs(g.gone) do ops[#ops + 1] = {'forget', rid} end
    local first = #ops
    for _, it in ipairs(g.items) do
      local a = it.job.ask
      local tenant = tostring(a.tenant or 'default')
      ops[#ops + 1] = {'acquire', it.rid, string.format('%d', tonumber(a.tokens) or 0),
        string.format('%d', tonumber(a.requests) or 1), tostring(jitter_u(it.rid, now)), tostring(a.mode or 'work'),
        tostring(asks.weights[tenant] or 1), tostring(asks.caps[tenant] or 0), tenant,
        string.format('%d', tonumber(a.output) or 0)}
    end
    -- A pacer that fails here (an error, a reply not understood) leaves its turns to
    -- the worker, which asks as before. Its releases moved the turns they let go in this
    -- same script (PACER_HOST, pacer_host.lua): due now, cleared.
    PACER_HOST.moved = {}
    PACER_HOST.own = {}
    for _, it in ipairs(g.items) do PACER_HOST.own[it.qid] = true end
    PACER_HOST.watch = watch
    local replies = pacer_batch(keys, g.route.cfg, now, ops)
    PACER_HOST.own, PACER_HOST.watch = nil, nil
    if replies then
      for k, it in ipairs(g.items) do
        local d = replies[first + k]
        -- A turn its own ask parked that a later op of the batch let go or retimed: the
        -- host noted it (pacer_host.lua `own`), and that stands — released, it stays
        -- queued, due now, marked released here (a fetch asks for it again: the pacer's
        -- `start`); retimed, it is due no later than the line's timer.
        local moved = type(d) == 'table' and d[1] == 1 and PACER_HOST.moved[it.qid]
        if type(moved) == 'number' then d[2] = math.min(tonumber(d[2]) or moved, math.max(moved - now, 1)) end
        if moved == true then
          -- (Its own ask, later in the batch, is not cleared: it stays queued, due now,
          -- released, as the host leaves a turn it releases.)
          it.job.cleared, it.job.released, it.job.pause_ms = true, true, nil
          it.r.payload = cjson.encode(it.job)
          redis.call('HSET', Q_JOBS, it.qid, q_encode(it.r))
          keep[it.qid] = now
        elseif type(d) == 'table' and d[1] == 0 then
          it.job.cleared = true
          it.job.released, it.job.due_at = nil, nil
          it.job.pause_ms = nil
          it.r.payload = cjson.encode(it.job)
        elseif type(d) == 'table' and d[1] == 1 then
          -- (A released turn whose reservation lapsed asked anew, and waits again.)
          it.job.cleared, it.job.released, it.job.due_at = nil, nil, nil
          local ms = math.max(math.floor(tonumber(d[2]) or 0), 1)
          if ms <= in_place then
            -- Owed a moment: leased (not started, unless for the probe), it waits in its
            -- worker (worker/src/pacing.rs `pace_at_start`).
            it.job.pause_ms = ms
            it.r.payload = cjson.encode(it.job)
            it.r.paused = tonumber(d[3]) == 3
          else
            keep[it.qid] = now + until_deadline(it.f, now, ms)
            wait_again(it, d, now)
          end
        end
      end
    end
  end
  return keep, watch
end

return q_fetch(tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5], start_leased, hold)
