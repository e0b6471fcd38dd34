-- The ops this script answers (the entry: dispatched last, when every function above is defined).
--
-- ARGV[1] op: batch | pull | snapshot
-- ARGV[2..15] config: floor (work turns), max_pace_ms, jitter_frac, jitter_max_ms, ttl_ms,
--          probe_wait_ms, late_ms, tpm, rpm, now in ms ('' = the server's TIME; tests only),
--          grace_ms, recheck_ms, floor (companion turns), whole_waits (1: waits are slept
--          whole and `pull` moves up the waiters near the head; model.rs, pull_in)
-- batch: ARGV[16..] a sequence of ops, each its name and its arguments, decided in order:
--   acquire id, tokens, requests, jitter_u, 'companion' | 'work', tenant weight, tenant cap
--           (0 none), tenant, output tokens reserved
--     -> {0} clear | {1, owed_ms, reason}   reason: 1 budget, 2 rate_limited, 3 probe, 4 fair_share
--   settle  id, used_tokens (-1 unknown), rate_limited_ms (-1 none), token limit, remaining,
--           reset_ms, the same for requests (-1 missing), headers_age_ms, input tokens the
--           provider counted (-1 unknown), input bucket limit, remaining, reset_ms, the same
--           for the output bucket   -> {0}
--   head    n: reads the line's first n waiters for the ops after it (no decision) -> {0}
--   pull    k: the first k waiters in line whose wait, predicted now, ends well before
--           their due time are moved up to it (model.rs, pull_in)
--     -> {id, due_ms, ...} (in a batch only from Lua, runs/fetch.lua: Rust reads integers)
--   -> one answer per op
-- pull: ARGV[16] k[, ARGV[17] n: `head` n first] -> {id, due_ms as text, ...} (the same op alone, for Rust)
-- snapshot: -> flat field list of the state, 'now', and 'rec:<id>' -> record for each record

if op == 'snapshot' then
  expire()
  save()
  local out = {}
  for k, v in pairs(S) do
    out[#out + 1] = k
    out[#out + 1] = fmt(v)
  end
  out[#out + 1] = 'now'
  out[#out + 1] = tostring(now)
  for id, r in pairs(F) do
    out[#out + 1] = 'rec:' .. id
    out[#out + 1] = rec_text(r)
  end
  local raw = redis.call('HGETALL', waiters)
  for i = 1, #raw, 2 do
    -- (A waiter that lapsed is not in line: live_waiter.)
    local w = live_waiter(raw[i], raw[i + 1])
    if w then
      out[#out + 1] = 'rec:' .. raw[i]
      out[#out + 1] = rec_text(w)
    end
  end
  return out
end

if op == 'pull' then
  if tonumber(ARGV[17]) then read_head(tonumber(ARGV[17])) end
  local out = pull_in(tonumber(ARGV[16]) or 0)
  save()
  for j = 2, #out, 2 do out[j] = string.format('%d', out[j]) end
  return out
end

-- A batch of asks and reports, in order, each as it would be alone at this `now`
-- (store.rs sends a process's concurrent calls of one budget and model together):
-- ARGV[16..] is each op's name and then its arguments (acquire: 9, settle: 17, pull: 1,
-- head: 1, fresh: 1, a reservation never asked for). The
-- state and the records are read once and written once, by save(), for the whole batch.
-- -> one reply per op: acquire {0} clear | {1, owed_ms, reason}; settle {0}.
if op == 'batch' then
  local out = {}
  local i = 16
  while i <= #ARGV do
    local name = ARGV[i]
    if name == 'acquire' then
      out[#out + 1] = acquire({unpack(ARGV, i + 1, i + 9)})
      i = i + 10
    elseif name == 'settle' then
      out[#out + 1] = settle({unpack(ARGV, i + 1, i + 17)})
      i = i + 18
    elseif name == 'pull' then
      out[#out + 1] = pull_in(tonumber(ARGV[i + 1]) or 0)
      i = i + 2
    elseif name == 'head' then
      read_head(tonumber(ARGV[i + 1]) or 0)
      out[#out + 1] = {0}
      i = i + 2
    elseif name == 'fresh' then
      -- Reservation ARGV[i + 1] was never asked for (a commit's ask for its next turn,
      -- store.lua): it has no waiter record, and its ask reads none.
      Wc[ARGV[i + 1]] = false
      out[#out + 1] = {0}
      i = i + 2
    else
      return redis.error_reply('unknown pacer op ' .. tostring(name))
    end
  end
  save()
  return out
end

return redis.error_reply('unknown pacer op ' .. tostring(op))
