-- The run store's queue as the shared pacer's host (pacer/lua/release.lua `PACER_HOST`):
-- a parked turn waits in the queue under its run's id, its payload carrying its ask, its
-- entry due at its safety deadline (or, at the head of its budget's line, at the line's
-- timer). Prepended, after the queue's library and its hooks, to every script that runs
-- the pacer's ops (the worker's batch loop: store.rs `pacer_host`; the run store's fetch
-- and commit).

-- The turn a reservation id (`run:turn:attempt`) names, its queue record and decoded
-- payload; nil when the run has no such turn queued or leased (cancelled, finished,
-- moved on). A leased one is a worker's that asked the pacer itself (pacing.rs) and
-- requeues it as it was owed, or calls: it is held, and nothing of it is moved.
local function host_turn(rid)
  local qid, turn, attempt = string.match(rid, '^(.*):(%d+):(%d+)$')
  if not qid then return nil end
  local r = q_read(qid)
  if not r or (r.flag ~= 'q' and r.flag ~= 'l') then return nil end
  local ok, job = pcall(cjson.decode, r.payload)
  if not ok or type(job) ~= 'table' or tonumber(job.turn) ~= tonumber(turn)
    or (tonumber(job.attempt) or 1) ~= tonumber(attempt) then
    return nil
  end
  return qid, r, job
end

local PACER_HOST = {}

-- The queue id of reservation `rid` when it is one of the turns the running fetch holds
-- (PACER_HOST.own, below), else nil.
local function own_qid(rid)
  if not PACER_HOST.own then return nil end
  local qid = string.match(rid, '^(.*):%d+:%d+$')
  return qid and PACER_HOST.own[qid] and qid or nil
end
-- `quiet`: set by a script whose caller's process fetches after it (the commit:
-- store.lua): a turn released here wakes no other worker — that fetch takes it, or takes
-- a full batch and passes the baton (queue/fetch.lua) — and `kicked` marks the reply so
-- the caller asks for that fetch (store.rs `commit_with_output`). A wake-up token per
-- release woke a second worker to an empty fetch.
PACER_HOST.quiet, PACER_HOST.kick = false, false
function PACER_HOST.kicked(out, now)
  if PACER_HOST.kick then
    -- (That fetch claims the watch of what it finds: a retime's time needs no more.)
    out[#out + 1] = 'k'
  elseif PACER_HOST.watch and #PACER_HOST.watch > 0 then
    -- The line's head moved up, and no fetch follows: the caller's process watches
    -- its time (`w` and the ms: store.rs, Lease::watch), claimed as q_wake_first
    -- claims it, with no token to wake another worker.
    local at = math.min(unpack(PACER_HOST.watch))
    if q_wake_first(at, now or q_now(), true) then out[#out + 1] = string.format('w%d', at) end
  end
  PACER_HOST.watch = nil
  return out
end

-- What this script's releases and retimes moved, queue id -> true (released) or the new
-- due time (retimed): a fetch that asks for the turns it holds reads it after its batch
-- (runs/fetch.lua `hold`), since a later op's release may move a turn an earlier op
-- parked, and the fetch's own answer for that turn must not undo it.
PACER_HOST.moved = {}

-- Set by the fetch while it asks for the turns it holds (runs/fetch.lua `hold`), nil
-- otherwise. `own`: queue id -> true for those turns: one the line releases or retimes
-- is not moved here (no record read or rewritten, nobody woken) — the fetch leases it
-- when its ask clears it, or leaves it queued at its new time — only noted in `moved`.
-- `watch`: the due times this script moved up, for the fetch's own watch (queue/fetch.lua:
-- it claims the earliest for its worker, or wakes one), instead of a token and a claim
-- for whoever takes it at each retime (a retime woke an idle worker to watch a time the
-- fetching worker, idle with a slot, would watch itself).
PACER_HOST.own, PACER_HOST.watch = nil, nil

-- Released: the turn is cleared (its reservation is held), its entry due now, and a
-- worker woken for it. `released`: the fetch that leases it tells the pacer its worker
-- has it (runs/fetch.lua; pacer release.rs `start`): from then on its call may reach the
-- provider. A leased turn is its worker's, between its own ask and what it does with the
-- answer: parked, it is requeued by the worker (store.lua `wait`), which reads the mark
-- left on its record here and makes it due now, released, instead of at the safety
-- deadline its ask was given (a release lost there left the turn stranded for that long).
function PACER_HOST.release(rid, now)
  local own = own_qid(rid)
  if own then
    PACER_HOST.moved[own] = true
    return true
  end
  local qid, r, job = host_turn(rid)
  if not qid then return false end
  job.cleared = true
  job.released = true
  job.pause_ms = nil
  r.payload = cjson.encode(job)
  if r.flag ~= 'q' then
    redis.call('HSET', Q_JOBS, qid, q_encode(r))
    return true
  end
  q_schedule(qid, r, now, now, PACER_HOST.quiet)
  if PACER_HOST.quiet then PACER_HOST.kick = true end
  PACER_HOST.moved[qid] = true
  return true
end

-- A worker's requeue of the turn it holds, parked by its own ask (store.lua `wait`): its
-- payload `next` and its delay, as the line left them while the turn was leased
-- (`held`, the leased record's payload, marked by PACER_HOST.release and .retime for the
-- same turn and attempt): released, due now, cleared and released; retimed, due no later
-- than the line's timer. `delay` and the result's are ms from `now`. Returns the payload
-- and the delay.
function PACER_HOST.requeue(held, next, delay, now)
  local ok, h = pcall(cjson.decode, held)
  if not ok or type(h) ~= 'table' or not (h.released or h.due_at) then return next, delay end
  local ok2, n = pcall(cjson.decode, next)
  if not ok2 or type(n) ~= 'table' or type(n.ask) ~= 'table' or tonumber(n.turn) ~= tonumber(h.turn)
    or (tonumber(n.attempt) or 1) ~= (tonumber(h.attempt) or 1) then
    return next, delay
  end
  if not h.released then return next, math.min(delay, math.max((tonumber(h.due_at) or now + delay) - now, 0)) end
  n.cleared, n.released, n.pause_ms = true, true, nil
  return cjson.encode(n), 0
end

-- Whether the turn is still there (queued or leased under that id).
function PACER_HOST.holds(rid)
  return host_turn(rid) ~= nil
end

-- The head of its line: its entry is due when the pacer weighs it next. A leased one's
-- record is marked (`due_at`) for its worker's requeue (PACER_HOST.requeue).
function PACER_HOST.retime(rid, at, now)
  local own = own_qid(rid)
  if own then
    if PACER_HOST.moved[own] ~= true then PACER_HOST.moved[own] = at end
    return true
  end
  -- Queued (the line's usual head): its entry moved up in one command that says so (a
  -- retime moves a timer up; LT: never a turn due sooner, were the waiter stale, so at
  -- worst an entry comes due early and asks again); not queued, under no such id, or not
  -- moved, it is read (a leased turn is marked, a gone one dropped) as before.
  local qid = string.match(rid, '^(.*):%d+:%d+$')
  if not (qid and redis.call('ZADD', Q_DUE, 'XX', 'LT', 'CH', at, qid) == 1) then
    local r, job
    qid, r, job = host_turn(rid)
    if not qid then return false end
    if r.flag ~= 'q' then
      job.due_at = at
      r.payload = cjson.encode(job)
      redis.call('HSET', Q_JOBS, qid, q_encode(r))
      return true
    end
    redis.call('ZADD', Q_DUE, 'XX', at, qid)
  end
  if PACER_HOST.watch then
    PACER_HOST.watch[#PACER_HOST.watch + 1] = at
  else
    q_wake_first(at, now)
  end
  if PACER_HOST.moved[qid] ~= true then PACER_HOST.moved[qid] = at end
  return true
end
