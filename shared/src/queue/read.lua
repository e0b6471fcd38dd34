-- Read-only views. ARGV[1] selects one:
--   counts: {now, ready, delayed, in_flight, dead, next_due_ms or -1}
--   dead ARGV[2]=limit, ARGV[3..4]=cursor (died-at ms, id; '' = none): {id, died_at, reason, payload, ...}, newest first
--   workers ARGV[2]=ttl_ms, KEYS[Q_NKEYS+1..2] workers, info: {identity, heartbeat, json, ...}
local now = q_now()
local view = ARGV[1]
if view == 'counts' then
  local ready = redis.call('ZCOUNT', Q_DUE, '-inf', now)
  local queued = redis.call('ZCARD', Q_DUE)
  local nxt = redis.call('ZRANGEBYSCORE', Q_DUE, '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  local next_due = -1
  if #nxt > 0 then next_due = tonumber(nxt[2]) end
  return {now, ready, queued - ready, redis.call('ZCARD', Q_LEASE), redis.call('ZCARD', Q_DEAD), next_due}
elseif view == 'dead' then
  -- A page, newest first, after the cursor (ARGV[3] died-at ms, ARGV[4] id; '' = from the newest).
  local limit, max, after = tonumber(ARGV[2]), ARGV[3] or '', ARGV[4] or ''
  if max == '' then max = '+inf' end
  local out, offset = {}, 0
  while #out < 4 * limit do
    local d = redis.call('ZREVRANGEBYSCORE', Q_DEAD, max, '-inf', 'WITHSCORES', 'LIMIT', offset, limit)
    if #d == 0 then break end
    offset = offset + #d / 2
    for i = 1, #d, 2 do
      -- Members of the cursor's own millisecond come in reverse order of their
      -- ids: skip up to and including the cursor.
      local fresh = after == '' or tonumber(d[i + 1]) < tonumber(max) or d[i] < after
      if fresh and #out < 4 * limit then
        local r = q_read(d[i])
        out[#out + 1] = d[i]; out[#out + 1] = d[i + 1]
        out[#out + 1] = redis.call('HGET', Q_REASONS, d[i]) or ''
        out[#out + 1] = r and r.payload or ''
      end
    end
  end
  return out
elseif view == 'workers' then
  -- ARGV[2] the reader's worker ttl (two of its leases), ARGV[3] the longest
  -- any: each worker is alive while its last heartbeat is younger than two of
  -- its own leases (its registration's lease_ms), else the reader's.
  local w = redis.call('ZRANGEBYSCORE', KEYS[Q_NKEYS + 1], now - tonumber(ARGV[3]), '+inf', 'WITHSCORES')
  local out = {}
  for i = 1, #w, 2 do
    local json = redis.call('HGET', KEYS[Q_NKEYS + 2], w[i]) or '{}'
    local ok, info = pcall(cjson.decode, json)
    local ttl = tonumber(ARGV[2])
    if ok and type(info) == 'table' and tonumber(info.lease_ms) and tonumber(info.lease_ms) > 0 then
      ttl = 2 * math.max(tonumber(info.lease_ms), tonumber(info.beat_ms) or 0)
    end
    if now - tonumber(w[i + 1]) <= ttl then
      out[#out + 1] = w[i]; out[#out + 1] = w[i + 1]; out[#out + 1] = json
    end
  end
  return out
end
return redis.error_reply('unknown view ' .. view)
