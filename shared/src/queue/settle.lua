-- A lease holder's verdict on its turn, checked against the lease's epoch.
-- ARGV: op, id, epoch, delay_ms, payload ('' keeps it; ops requeue), has_payload
-- ('1'/'0'), reason, max_deliveries, dead_keep_ms (the dead set's retention).
--   complete: done, removed.
--   requeue:  due again after delay_ms (server clock), deliveries reset (the turn progressed).
--   retry:    a failed delivery: due again after delay_ms, or dead when it used its deliveries.
--   release:  handed back unstarted or unfinished at shutdown: due now, the delivery not counted.
--   dead:     to the dead set with the reason.
-- Returns {'ok'} / {'dead'} or {'fenced', why}.
local op, id, epoch = ARGV[1], ARGV[2], ARGV[3]
local r, why = q_fence(id, epoch)
if not r then return {'fenced', why} end
if op == 'complete' then
  -- (Its holder is done, and its record gone: nothing of this lease is left to fence.)
  q_finish(id)
  return {'ok'}
end
-- The lease ends and the turn goes on: a run's record stops naming it (a `dead` fails
-- the run, which clears it too).
q_unfence(id, r.epoch)
-- Only the other verdicts need the clock.
local now = q_now()
if op == 'requeue' then
  if ARGV[6] == '1' then r.payload = ARGV[5] end
  r.deliveries = 0
  q_schedule(id, r, now + tonumber(ARGV[4]), now)
elseif op == 'retry' then
  if r.deliveries >= tonumber(ARGV[8]) then
    q_bury(id, r, ARGV[7], now, ARGV[9])
    return {'dead'}
  end
  q_schedule(id, r, now + tonumber(ARGV[4]), now)
elseif op == 'release' then
  if r.deliveries > 0 then r.deliveries = r.deliveries - 1 end
  q_schedule(id, r, now, now)
elseif op == 'dead' then
  q_bury(id, r, ARGV[7], now, ARGV[9])
  return {'dead'}
else
  return redis.error_reply('unknown op ' .. op)
end
return {'ok'}
