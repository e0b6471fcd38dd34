-- The shared pacer's atomic operations: the model of bucket.rs as one Redis script.
--
-- Every check-and-update of a budget is one call of this script, so 16 workers
-- that all saw "remaining: 50 000" cannot each send 20 000 tokens: the first
-- reservation lowers the level the second one sees. Time is the Redis server's
-- clock (TIME), in milliseconds, so workers on different hosts agree.
--
-- KEYS[1] state hash   (t_* token bucket, r_* request bucket, blocked_until, probe_until, observed_at)
-- KEYS[2] reservations zset: id -> expiry ms
-- KEYS[3] reservations hash: id -> "kind|tokens|requests|due|line_tokens|line_requests|mark|output|tenant"
--         (mark: the token bucket's cumulative refunds when an in-flight call was sent;
--          output: the part of tokens reserved for output)
--         (kind: f = in flight, b = booked by a work turn, l = booked by a live
--          (companion) turn; line_* = what a booking holds on the line)
-- ARGV[1] op: acquire | settle | snapshot
-- ARGV[2..10] config: floor, max_pace_ms, jitter_frac, jitter_max_ms, ttl_ms, probe_wait_ms,
--          fair_horizon_ms, tpm, rpm
-- ARGV[11] now in ms, or '' for the server's TIME (tests pass a clock; production never does)
-- acquire: ARGV[12] id, [13] tokens, [14] requests, [15] jitter_u, [16] 'companion' | 'work',
--          [17] tenant weight, [18] tenant cap (0 none), [19] tenant, [20] booking grace ms,
--          [21] output tokens reserved (part of [13]; 0: not split)
--   -> {0} clear | {1, owed_ms, reason, booked, waiting_position (-1 none)}
--      reason: 1 budget, 2 rate_limited, 3 probe, 4 fair_share
-- settle:  ARGV[12] id, [13] used_tokens (-1 unknown), [14] rate_limited_ms (-1 none),
--          [15..17] token limit, remaining, reset_ms, [18..20] same for requests (-1 missing),
--          [21] headers_age_ms
-- snapshot: -> flat field list of the state, plus "now"

local state, resv, resv_data = KEYS[1], KEYS[2], KEYS[3]
local op = ARGV[1]
local floor = tonumber(ARGV[2])
local max_pace = tonumber(ARGV[3])
local jitter_frac = tonumber(ARGV[4])
local jitter_max = tonumber(ARGV[5])
local ttl = tonumber(ARGV[6])
local probe_wait = tonumber(ARGV[7])
local fair_horizon = tonumber(ARGV[8])
local tpm = tonumber(ARGV[9])
local rpm = tonumber(ARGV[10])

local now = tonumber(ARGV[11])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function fmt(x) return string.format('%.17g', x) end

-- Load the state into a table of numbers.
local S = {}
do
  local raw = redis.call('HGETALL', state)
  for i = 1, #raw, 2 do S[raw[i]] = tonumber(raw[i + 1]) end
end
local function get(k) return S[k] or 0 end

local function known(p) return get(p .. 'limit') > 0 and get(p .. 'rate') > 0 end

local function level_at(p, at)
  local elapsed = math.max(at - get(p .. 'at'), 0)
  return math.min(get(p .. 'level') + get(p .. 'rate') * elapsed, get(p .. 'limit'))
end

local function advance(p)
  if now > get(p .. 'at') then
    S[p .. 'level'] = level_at(p, now)
    S[p .. 'at'] = now
  end
end

local function per_minute(p, limit)
  S[p .. 'limit'] = limit
  S[p .. 'rate'] = limit / 60000
  S[p .. 'level'] = limit
  S[p .. 'at'] = now
  S[p .. 'booked'] = 0
  S[p .. 'inflight'] = 0
end

local function ensure_configured()
  if not known('t_') and tpm > 0 then per_minute('t_', tpm) end
  if not known('r_') and rpm > 0 then per_minute('r_', rpm) end
end

-- Milliseconds until `short` tokens have returned, never past the reset.
local function refill_ms(p, short)
  if short <= 0 then return 0 end
  local full_at = get(p .. 'full_at')
  if full_at > now then return math.min(short / get(p .. 'rate'), full_at - now) end
  return short / get(p .. 'rate')
end

local function ms_until(p, need)
  return refill_ms(p, need - level_at(p, now))
end

-- At the provider's reset the bucket is full again but for what was sent since
-- (and what is booked): lift the level to that (a window bucket refills at once).
local function lift(p)
  local full_at = get(p .. 'full_at')
  if full_at > 0 and now >= full_at then
    advance(p)
    S[p .. 'level'] = math.max(get(p .. 'level'), get(p .. 'limit') - get(p .. 'charged_since') - get(p .. 'booked'))
    S[p .. 'full_at'] = 0
  end
end

local function need(p, cost)
  local limit = get(p .. 'limit')
  return math.min(cost + floor * limit, limit)
end

local function owed(ms, reason, booked, u)
  local base = math.max(math.ceil(ms), 1)
  local jitter = math.min(base * jitter_frac, jitter_max) * math.min(math.max(u, 0), 1)
  return {1, math.ceil(base + jitter), reason, booked, -1}
end

-- Fair admission: the other tenants with turns waiting in their lines — their
-- weights summed and the least virtual time among them (nil: no one else).
local function others_waiting(t)
  local weights, least = 0, nil
  for k, v in pairs(S) do
    local name = string.match(k, '^tn:(.*)$')
    if name and name ~= t and v - get('ts:' .. name) > 0.5 then
      weights = weights + get('tw:' .. name)
      local tag = get('tv:' .. name)
      if least == nil or tag < least then least = tag end
    end
  end
  return weights, least
end

-- Records a turn waiting in its tenant's line (kind w) with its position.
local function wait_in_line(id, r, tokens, requests, lt, pos, tenant)
  r[5] = pos
  local rec = 'w|' .. fmt(tokens) .. '|' .. fmt(requests) .. '|' .. string.format('%d', now + r[2]) .. '|'
    .. fmt(lt) .. '|' .. fmt(requests) .. '|' .. string.format('%d', pos) .. '|' .. r[3] .. '|' .. tenant
  redis.call('HSET', resv_data, id, rec)
  redis.call('ZADD', resv, now + r[2] + tonumber(ARGV[20]), id)
  return r
end

-- A work turn of `t` is sent (clear, or its booking claimed): its line moves.
local function serve(t, lt)
  if t and t ~= '' and S['tn:' .. t] ~= nil then
    S['ts:' .. t] = get('ts:' .. t) + lt
    S['tadm:' .. t] = get('tadm:' .. t) + lt
  end
end

-- A booking that expired returns its budget; an in-flight reservation that
-- expired (its worker died) stays spent and returns by refill.
local function expire()
  local gone = redis.call('ZRANGEBYSCORE', resv, '-inf', now, 'LIMIT', 0, 64)
  for _, id in ipairs(gone) do
    local rec = redis.call('HGET', resv_data, id)
    if rec and string.sub(rec, 1, 1) == 'w' then
      -- A turn that never came back from its tenant's line gives up its place.
      local ltk, tenant = string.match(rec, '^w|[%d.]+|[%d.]+|%d+|([%d.]+)|[%d.]+|%d+|%d+|(.*)$')
      if tenant then S['ts:' .. tenant] = get('ts:' .. tenant) + tonumber(ltk) end
    elseif rec then
      local kind, tk, rq, _, ltk, lrq, tenant =
        string.match(rec, '^(%a)|([%d.]+)|([%d.]+)|(%d+)|([%d.]+)|([%d.]+)|[%d.e+-]+|[%d.]+|(.*)$')
      local booking = kind == 'b' or kind == 'l'
      if booking then tk, rq = tonumber(ltk), tonumber(lrq) else tk, rq = tonumber(tk), tonumber(rq) end
      if kind == 'b' and tenant ~= '' and S['tn:' .. tenant] ~= nil then
        -- A booked work turn that never came back gives up its place.
        S['ts:' .. tenant] = get('ts:' .. tenant) + tk
      end
      for _, pc in ipairs({{'t_', tk}, {'r_', rq}}) do
        local p, cost = pc[1], pc[2]
        if known(p) then
          if booking then
            advance(p)
            local c = math.min(cost, get(p .. 'booked'))
            S[p .. 'booked'] = get(p .. 'booked') - c
            if kind == 'l' then S[p .. 'booked_live'] = math.max(get(p .. 'booked_live') - c, 0) end
            S[p .. 'level'] = math.min(get(p .. 'level') + c, get(p .. 'limit'))
          else
            S[p .. 'inflight'] = math.max(get(p .. 'inflight') - cost, 0)
          end
        end
      end
    end
    redis.call('HDEL', resv_data, id)
  end
  if #gone > 0 then redis.call('ZREM', resv, unpack(gone)) end
end

local function observe(p, limit, remaining, reset_ms, headers_at, refund)
  if limit < 0 or remaining < 0 or limit == 0 then return end
  local has_reset = reset_ms >= 0
  if reset_ms < 0 then reset_ms = 0 end
  if reset_ms > max_pace then return end
  remaining = math.min(remaining, limit)
  local missing = limit - remaining
  if reset_ms >= 20 and missing >= limit * 0.1 then
    S[p .. 'rate'] = missing / reset_ms
    S[p .. 'rated'] = 1
  elseif reset_ms >= 20 and missing >= limit * 0.005 and (get(p .. 'rated') == 0 or missing / reset_ms > get(p .. 'rate')) then
    -- A lightly used bucket's reading may only raise the rate.
    S[p .. 'rate'] = missing / reset_ms
    S[p .. 'rated'] = 1
  elseif get(p .. 'rate') <= 0 or get(p .. 'limit') ~= limit then
    S[p .. 'rate'] = limit / 60000
  end
  if get(p .. 'limit') <= 0 then
    S[p .. 'level'] = limit
    S[p .. 'at'] = now
  end
  S[p .. 'limit'] = limit
  advance(p)
  local elapsed = math.max(now - headers_at, 0)
  local theirs = math.min(remaining + refund + get(p .. 'rate') * elapsed, limit) - get(p .. 'booked')
  if theirs < get(p .. 'level') then S[p .. 'level'] = theirs end
  if has_reset and headers_at >= get(p .. 'full_seen') then
    S[p .. 'full_seen'] = headers_at
    S[p .. 'full_at'] = headers_at + reset_ms
    -- The calls still in flight may not be in these headers yet.
    S[p .. 'charged_since'] = get(p .. 'inflight')
  end
end

local function save()
  local flat = {}
  for k, v in pairs(S) do
    flat[#flat + 1] = k
    flat[#flat + 1] = fmt(v)
  end
  if #flat > 0 then redis.call('HSET', state, unpack(flat)) end
end

local function reserve(id, kind, tk, rq, due, expiry, ltk, lrq, tenant, out, mark)
  redis.call('HSET', resv_data, id, kind .. '|' .. fmt(tk) .. '|' .. fmt(rq) .. '|' .. string.format('%d', due)
    .. '|' .. fmt(ltk) .. '|' .. fmt(lrq) .. '|' .. fmt(mark or 0) .. '|' .. fmt(out) .. '|' .. (tenant or ''))
  redis.call('ZADD', resv, expiry, id)
end

-- A call's input part and output reservation, as the usage ratio sees them.
local function split(tokens, out)
  if out <= 0 then return 0, tokens end
  out = math.min(out, tokens)
  return tokens - out, out
end

-- What a booking holds on the line: the expected use (see bucket.rs).
local function line_cost(tokens, out)
  local ratio = get('usage_ratio')
  if ratio <= 0 then ratio = 1 end
  ratio = math.min(math.max(ratio, 0.05), 1)
  local input, output = split(tokens, out)
  return math.ceil(input + output * ratio)
end

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
  out[#out + 1] = 'reservations'
  out[#out + 1] = tostring(redis.call('ZCARD', resv))
  return out
end

if op == 'acquire' then
  local id = ARGV[12]
  local tokens, requests, u = tonumber(ARGV[13]), tonumber(ARGV[14]), tonumber(ARGV[15])
  local output = tonumber(ARGV[21])
  ensure_configured()
  expire()
  -- A booked turn that comes back is clear once the bucket holds its whole
  -- reservation (never before its due time); otherwise it keeps its booking.
  -- A turn back from its tenant's line asks again from its place in it.
  local rec = redis.call('HGET', resv_data, id)
  local position = nil
  if rec and string.sub(rec, 1, 1) == 'w' then
    local due, pos, reason = string.match(rec, '^w|[%d.]+|[%d.]+|(%d+)|[%d.]+|[%d.]+|(%d+)|(%d+)|')
    if now < tonumber(due) then
      save()
      return {1, tonumber(due) - now, tonumber(reason), 0, tonumber(pos)}
    end
    redis.call('HDEL', resv_data, id)
    redis.call('ZREM', resv, id)
    position = tonumber(pos)
    rec = nil
  end
  if rec then
    local kind, tk, rq, due, ltk, lrq, rout, rtenant =
      string.match(rec, '^(%a)|([%d.]+)|([%d.]+)|(%d+)|([%d.]+)|([%d.]+)|[%d.e+-]+|([%d.]+)|(.*)$')
    tk, rq, due, ltk, lrq, rout = tonumber(tk), tonumber(rq), tonumber(due), tonumber(ltk), tonumber(lrq), tonumber(rout)
    local booking = kind == 'b' or kind == 'l'
    if booking and now < due then
      save()
      return {1, due - now, 1, 1, -1}
    end
    if booking then
      -- Live bookings are ahead of work turns (a live turn's own is its own).
      lift('t_')
      lift('r_')
      local short = 0
      for _, pc in ipairs({{'t_', tk, ltk}, {'r_', rq, lrq}}) do
        local p, cost, lc = pc[1], pc[2], pc[3]
        if known(p) then
          advance(p)
          local n = need(p, cost)
          local own = 0
          if kind == 'l' then own = lc end
          local truth = get(p .. 'level') + get(p .. 'booked') - get(p .. 'booked_live') + own
          if truth < n then short = math.max(short, refill_ms(p, n - truth)) end
        end
      end
      if short > 0 then
        local r = owed(short, 1, 1, u)
        reserve(id, kind, tk, rq, now + r[2], now + r[2] + tonumber(ARGV[20]), ltk, lrq, rtenant, rout)
        save()
        return r
      end
      for _, x in ipairs({{'t_', tk, ltk}, {'r_', rq, lrq}}) do
        local p, cost, lc = x[1], x[2], x[3]
        if known(p) then
          S[p .. 'booked'] = math.max(get(p .. 'booked') - lc, 0)
          if kind == 'l' then S[p .. 'booked_live'] = math.max(get(p .. 'booked_live') - lc, 0) end
          S[p .. 'inflight'] = get(p .. 'inflight') + cost
          S[p .. 'charged_since'] = get(p .. 'charged_since') + cost
          S[p .. 'level'] = get(p .. 'level') - (cost - lc)
        end
      end
      if kind == 'b' then serve(rtenant, ltk) end
    end
    reserve(id, 'f', tk, rq, now, now + ttl, ltk, lrq, rtenant, rout, get('t_refunded'))
    save()
    return {0}
  end
  -- A turn back from its tenant's line keeps its place while it waits for
  -- something else (a closed window, a probe).
  local function keep_place(r)
    if position then
      wait_in_line(id, r, tokens, requests, line_cost(tokens, output), position, ARGV[19])
    end
    save()
    return r
  end
  if now < get('blocked_until') then
    return keep_place(owed(get('blocked_until') - now, 2, 0, u))
  end
  if not known('t_') and not known('r_') then
    if now < get('probe_until') then
      return keep_place(owed(math.min(get('probe_until') - now, probe_wait), 3, 0, u))
    end
    S['probe_until'] = now + probe_wait * 10
    save()
    return {0}
  end
  -- Clear only if the call fits now and at the last booking's due time (so
  -- it delays no booked turn): refunds are then used at once.
  -- Live turns first: a companion turn ignores the work line and has only
  -- other live bookings ahead of it.
  lift('t_')
  lift('r_')
  local live = ARGV[16] == 'companion'
  local weight, cap, tenant = tonumber(ARGV[17]), tonumber(ARGV[18]), ARGV[19]
  local lt = line_cost(tokens, output)
  -- Fair admission (work turns): the tenant's line first. A turn with more of
  -- its tenant's line ahead than the horizon waits there and comes back when
  -- it is closer; otherwise it is admitted no earlier than its share allows.
  local share_wait = 0
  if not live and known('t_') then
    local others_weight, least = others_waiting(tenant)
    local w = math.max(weight, 0.001)
    -- Virtual time runs at the refill over the waiting tenants' weights; the
    -- tenant's share of the refill is its weight's worth, never above its cap.
    local pace = get('t_rate') / (w + others_weight)
    local rate = pace * w
    if cap > 0 then rate = math.min(rate, get('t_rate') * cap) end
    S['tn:' .. tenant] = get('tn:' .. tenant)
    S['ts:' .. tenant] = get('ts:' .. tenant)
    S['tw:' .. tenant] = weight
    if not position and get('tn:' .. tenant) - get('ts:' .. tenant) <= 0.5 then
      -- Back from idle: no credit for the time away (nor debt for what it
      -- used while the others could not).
      S['tv:' .. tenant] = math.max(get('tv:' .. tenant), get('fair_time'))
    end
    local pos = position or (get('tn:' .. tenant) + lt)
    local ahead = math.max(pos - lt - get('ts:' .. tenant), 0)
    -- A tenant more than a quarter horizon of virtual time ahead of the
    -- furthest behind lets the others catch up.
    local lead = 0
    if least ~= nil then lead = get('tv:' .. tenant) - least - fair_horizon * pace / 4 end
    if ahead / rate > fair_horizon or lead > 0 then
      if not position then
        S['tn:' .. tenant] = pos
        S['twait:' .. tenant] = get('twait:' .. tenant) + 1
      end
      local reason = 1
      if least ~= nil then reason = 4 end
      local ms = 0
      if ahead / rate > fair_horizon then ms = ahead / rate - fair_horizon / 2 end
      if lead > 0 then ms = math.max(ms, lead / pace, fair_horizon / 16) end
      local r = wait_in_line(id, owed(ms, reason, 0, u), tokens, requests, lt, math.floor(pos + 0.5), tenant)
      save()
      return r
    end
    local start = get('tv:' .. tenant)
    S['tv:' .. tenant] = start + lt / w
    if least ~= nil then start = math.min(start, least) end
    S['fair_time'] = math.max(get('fair_time'), start)
    if not position then S['tn:' .. tenant] = pos end
    -- served moves when the turn is sent, so booked turns count as ahead: each
    -- tenant keeps at most its share of the horizon on the bucket's line.
    if cap > 0 then share_wait = get('tc:' .. tenant) - now end
  end
  local horizon = math.max(get('last_due'), now)
  local fits = true
  local wait = 0
  for _, pc in ipairs({{'t_', tokens, lt}, {'r_', requests, requests}}) do
    local p, cost, lc = pc[1], pc[2], pc[3]
    if known(p) then
      advance(p)
      local n = need(p, cost)
      local present = get(p .. 'level') + get(p .. 'booked') - get(p .. 'booked_live')
      if live then
        if present < n then fits = false end
        wait = math.max(wait, refill_ms(p, need(p, lc) - present))
      else
        if level_at(p, horizon) < n or present < n then fits = false end
        wait = math.max(wait, ms_until(p, need(p, lc)))
      end
    end
  end
  if fits and share_wait <= 0 then wait = 0 else wait = math.max(wait, share_wait, 1) end
  if not live and cap > 0 and known('t_') then
    local start = now + math.ceil(wait)
    S['tc:' .. tenant] = math.max(get('tc:' .. tenant), start) + math.ceil(lt / (get('t_rate') * cap))
  end
  for _, pc in ipairs({{'t_', tokens, lt}, {'r_', requests, requests}}) do
    local p, cost, lc = pc[1], pc[2], pc[3]
    if known(p) then
      if wait > 0 then
        S[p .. 'level'] = get(p .. 'level') - lc
        S[p .. 'booked'] = get(p .. 'booked') + lc
        if live then S[p .. 'booked_live'] = get(p .. 'booked_live') + lc end
      else
        S[p .. 'level'] = get(p .. 'level') - cost
        S[p .. 'inflight'] = get(p .. 'inflight') + cost
        S[p .. 'charged_since'] = get(p .. 'charged_since') + cost
      end
    end
  end
  local tk = known('t_') and tokens or 0
  local rq = known('r_') and requests or 0
  local ltk = known('t_') and lt or 0
  if wait <= 0 then
    if not live then serve(tenant, lt) end
    reserve(id, 'f', tk, rq, now, now + ttl, ltk, rq, '', known('t_') and output or 0, get('t_refunded'))
    save()
    return {0}
  end
  local r = owed(wait, 1, 1, u)
  local kind, btenant = 'b', tenant
  if live then kind, btenant = 'l', '' else S['last_due'] = math.max(get('last_due'), now + r[2]) end
  reserve(id, kind, tk, rq, now + r[2], now + r[2] + tonumber(ARGV[20]), ltk, rq, btenant, known('t_') and output or 0)
  save()
  return r
end

if op == 'settle' then
  local id = ARGV[12]
  local used = tonumber(ARGV[13])
  local limited = tonumber(ARGV[14])
  ensure_configured()
  expire()
  local tk, rq, out, others = 0, 0, 0, 0
  local rec = redis.call('HGET', resv_data, id)
  if rec then
    local kind, a, b, mark, o = string.match(rec, '^(%a)|([%d.]+)|([%d.]+)|%d+|[%d.]+|[%d.]+|([%d.e+-]+)|([%d.]+)|')
    if kind == 'f' then
      tk, rq, out = tonumber(a), tonumber(b), tonumber(o)
      -- What others gave back since this call was sent: its headers cannot show it.
      others = math.max(get('t_refunded') - tonumber(mark), 0)
    end
    redis.call('HDEL', resv_data, id)
    redis.call('ZREM', resv, id)
  end
  local input, output = split(tk, out)
  if limited < 0 and used >= 0 and output > 0 then
    local prior = get('usage_ratio')
    if prior <= 0 then prior = 1 end
    S['usage_ratio'] = 0.8 * prior + 0.2 * math.min(math.max((used - input) / output, 0), 1)
  end
  local refund_t, refund_r = 0, 0
  if limited >= 0 then
    refund_t, refund_r = tk, rq
  elseif used >= 0 then
    refund_t = math.max(tk - used, 0)
  end
  for _, x in ipairs({{'t_', tk, refund_t}, {'r_', rq, refund_r}}) do
    local p, reserved, refund = x[1], x[2], x[3]
    advance(p)
    S[p .. 'inflight'] = math.max(get(p .. 'inflight') - reserved, 0)
    S[p .. 'level'] = math.min(get(p .. 'level') + refund, math.max(get(p .. 'limit'), get(p .. 'level')))
    S[p .. 'refunded'] = get(p .. 'refunded') + refund
    S[p .. 'charged_since'] = math.max(get(p .. 'charged_since') - refund, 0)
  end
  local age = tonumber(ARGV[21])
  local headers_at = now - age
  observe('t_', tonumber(ARGV[15]), tonumber(ARGV[16]), tonumber(ARGV[17]), headers_at, refund_t + others)
  observe('r_', tonumber(ARGV[18]), tonumber(ARGV[19]), tonumber(ARGV[20]), headers_at, refund_r)
  if tonumber(ARGV[16]) >= 0 or tonumber(ARGV[19]) >= 0 then
    S['observed_at'] = now
    S['probe_until'] = 0
  end
  if limited >= 0 then
    -- The provider says the window is closed for every worker; what is left
    -- after it is what the 429's headers say; without headers, remaining = 0.
    S['blocked_until'] = math.max(get('blocked_until'), headers_at + limited)
    for _, pr in ipairs({{'t_', tonumber(ARGV[16])}, {'r_', tonumber(ARGV[19])}}) do
      local p, remaining = pr[1], pr[2]
      if known(p) and remaining < 0 then S[p .. 'level'] = math.min(get(p .. 'level'), -get(p .. 'booked')) end
    end
  end
  save()
  return {0}
end

return redis.error_reply('unknown pacer op ' .. tostring(op))
