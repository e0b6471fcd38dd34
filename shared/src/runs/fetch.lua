-- The run store's fetch (store.rs `RunStore::fetch_script`), on the queue's library,
-- the run store's (runs/lib.lua) and the queue's fetch (queue/fetch.lua), prepended:
-- each turn it leases is started in the same script, unless its payload carries a pacer
-- ask it has to make first (not one cleared already: store.rs `Turn::cleared`) or a
-- format this version does not read (the worker buries it).
-- ARGV[1..4] the queue's fetch's; ARGV[5] the history depth in turns (0: all); ARGV[6]
-- the payload format this version reads. A run's keys are named from its id, beside the
-- queue's dead set, as keys.rs builds them (the queue's slot; q_fail_run does the same).
local max_hist, format = tonumber(ARGV[5]) or 0, tonumber(ARGV[6]) or 1
local base = string.sub(Q_DEAD, 1, #Q_DEAD - #'q:dead')
local function start_leased(qid, r)
  local ok, job = pcall(cjson.decode, r.payload)
  if not ok or type(job) ~= 'table' or (job.ask ~= nil and not job.cleared) or type(job.turn) ~= 'number'
    or (tonumber(job.v) or 1) > format then
    return nil
  end
  RUN, TX, EV, id = base .. 'run:' .. qid, base .. 'tx:' .. qid, base .. 'ev:' .. qid, qid
  return start_turn(tostring(r.epoch), string.format('%d', job.turn), string.format('%d', tonumber(job.attempt) or 1), max_hist)
end
return q_fetch(tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4], start_leased)
