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
-- `quiet`: set by a script whose caller's process fetches after it (the commit:
-- store.lua): a turn released here wakes no other worker — that fetch takes it, or takes
-- a full batch and passes the baton (queue/fetch.lua) — and `kicked` marks the reply so
-- the caller asks for that fetch (store.rs `commit_with_output`). A wake-up token per
-- release woke a second worker to an empty fetch.
PACER_HOST.quiet, PACER_HOST.kick = false, false
function PACER_HOST.kicked(out)
  if PACER_HOST.kick then out[#out + 1] = 'k' end
  return out
end

-- Released: the turn is cleared (its reservation is held), its entry due now, and a
-- worker woken for it. `released`: the fetch that leases it tells the pacer its worker
-- has it (runs/fetch.lua; pacer release.rs `start`): from then on its call may reach the
-- provider.
function PACER_HOST.release(rid, now)
  local qid, r, job = host_turn(rid)
  if not qid then return false end
  if r.flag ~= 'q' then return true end
  job.cleared = true
  job.released = true
  job.pause_ms = nil
  r.payload = cjson.encode(job)
  q_schedule(qid, r, now, now, PACER_HOST.quiet)
  if PACER_HOST.quiet then PACER_HOST.kick = true end
  return true
end

-- Whether the turn is still there (queued or leased under that id).
function PACER_HOST.holds(rid)
  return host_turn(rid) ~= nil
end

-- The head of its line: its entry is due when the pacer weighs it next.
function PACER_HOST.retime(rid, at, now)
  local qid, r = host_turn(rid)
  if not qid then return false end
  if r.flag ~= 'q' then return true end
  redis.call('ZADD', Q_DUE, 'XX', at, qid)
  q_wake_for(at, now)
  return true
end
