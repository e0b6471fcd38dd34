-- The ops this script answers (the entry: dispatched last, when every function above is
-- defined; shared/src/pacer/ops.rs writes them).
--
-- ARGV[1] op: batch | snapshot
-- ARGV[2..15] config: floor (work turns), max_pace_ms, jitter_frac, jitter_max_ms, ttl_ms,
--          probe_wait_ms, late_ms, tpm, rpm, now in ms ('' = the server's TIME; tests only),
--          grace_ms (a head without a host not back this long after its due time leaves the
--          line), recheck_ms, floor (companion turns), parks ('1': a host moves the waiting
--          turns; model.rs PacingConfig::parks)
-- batch: ARGV[16..] a sequence of ops, each its name and its arguments, decided in order,
-- with the line's release (release.lua) before an ask and after a settle or a forget:
--   acquire id, tokens, requests, jitter_u, 'companion' | 'work', tenant weight, tenant cap
--           (0 none), tenant, output tokens reserved
--     -> {0} clear | {1, due_ms, reason, eta_ms}   reason: 1 budget, 2 rate_limited,
--           3 probe, 4 fair_share; due_ms: when its queue entry is due (a parked turn is
--           released before then); eta_ms: when it is expected clear
--   settle  id, used_tokens (-1 unknown), rate_limited_ms (-1 none), token limit, remaining,
--           reset_ms, the same for requests (-1 missing), headers_age_ms, input tokens the
--           provider counted (-1 unknown), input bucket limit, remaining, reset_ms, the same
--           for the output bucket   -> {0}
--   forget  id: a waiting turn whose run ended leaves the line -> {0}
--   fresh   id: a reservation never asked for (a commit's ask for its next turn): its ask
--           reads no waiter record -> {0}
--   moves   -> {id, at, 1 released | 0 retimed, ...}: what this call's releases moved
--   -> one answer per op
-- snapshot: -> flat field list of the state, 'now', and 'rec:<id>' -> record for each call
--   in flight and for the first SNAPSHOT_WAITERS waiters in line (the state's nw counts
--   them all)

local SNAPSHOT_WAITERS = 200

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
  if not no_waiters then
    local ids = redis.call('ZRANGE', line_key, 0, SNAPSHOT_WAITERS - 1)
    if #ids > 0 then
      local raw = redis.call('HMGET', waiters, unpack(ids))
      local hid, h = head()
      for i, id in ipairs(ids) do
        -- (The head's record is the state's hd field: line.lua `put`.)
        local w = (id == hid and h) or rec_decode(raw[i])
        if w and w[KIND] == 'w' then
          out[#out + 1] = 'rec:' .. id
          out[#out + 1] = rec_text(w)
        end
      end
    end
  end
  return out
end

-- A batch of asks and reports, in order, each as it would be alone at this `now`
-- (shared_pacer.rs sends a process's concurrent calls of one budget and model together;
-- the run store's fetch and commit send theirs: batch.lua). The state and the calls in
-- flight are read once and written once, by save(), for the whole batch.
if op == 'batch' then
  local out = {}
  local i = 16
  while i <= #ARGV do
    local name = ARGV[i]
    if name == 'acquire' then
      -- The line lets go what fits first, so that the answer is the line's (a
      -- waiter that would go is not told to wait).
      release()
      out[#out + 1] = acquire({unpack(ARGV, i + 1, i + 9)})
      i = i + 10
    elseif name == 'settle' then
      out[#out + 1] = settle({unpack(ARGV, i + 1, i + 17)})
      release()
      i = i + 18
    elseif name == 'forget' then
      forget(ARGV[i + 1])
      release()
      out[#out + 1] = {0}
      i = i + 2
    elseif name == 'fresh' then
      Wc[ARGV[i + 1]] = false
      out[#out + 1] = {0}
      i = i + 2
    elseif name == 'moves' then
      local flat = {}
      for _, m in ipairs(moves) do
        flat[#flat + 1] = m[1]
        flat[#flat + 1] = string.format('%d', m[2])
        flat[#flat + 1] = tostring(m[3])
      end
      out[#out + 1] = flat
      i = i + 1
    else
      return redis.error_reply('unknown pacer op ' .. tostring(name))
    end
  end
  save()
  return out
end

return redis.error_reply('unknown pacer op ' .. tostring(op))
