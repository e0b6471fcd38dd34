-- model.rs
-- A call in flight leaves the model unsettled, lapsed or forgotten (model.rs,
-- drop_flight): one the line released that was never started reached no provider, and
-- its reservation comes back whole.
local function drop_flight(id, r)
  local held = {r[TOKENS], r[REQUESTS], r[IH], r[OH]}
  for i, p in ipairs(BUCKETS) do
    S[p .. 'inflight'] = math.max(get(p .. 'inflight') - held[i], 0)
    if r[STARTED] ~= 1 then
      UNSENT[p] = math.max(UNSENT[p] - held[i], 0)
      credit(p, held[i])
    end
  end
  drop(id)
end

-- Drops the calls past their reservation's TTL (a parked waiter never lapses: it leaves
-- the line when released, or when its host no longer holds it: release.lua).
-- Once per `now`: what an op of the same batch puts lapses later (TTL > 0).
local expired_at = nil
local function expire()
  if expired_at == now and ttl > 0 then return end
  expired_at = now
  count_unsent()
  for id, r in pairs(F) do
    if r[EXPIRY] <= now then drop_flight(id, r) end
  end
end

-- Lifts both buckets at their reset; a window's lift subtracts what was
-- cleared within late_ms before its boundary (it may have arrived after).
local function lift_all()
  local recent = {t_ = 0, r_ = 0, i_ = 0, o_ = 0}
  local lifts, any = {}, false
  for _, p in ipairs(BUCKETS) do
    lifts[p] = get(p .. 'refill') == WINDOW and get(p .. 'full_at') > 0 and now >= get(p .. 'full_at')
    any = any or lifts[p]
  end
  if any then
    for _, f in pairs(F) do
      do
        local held = {f[TOKENS], f[REQUESTS], f[IH], f[OH]}
        for j, p in ipairs(BUCKETS) do
          if lifts[p] and (f[STARTED] ~= 1 or f[EXPIRY] - ttl >= get(p .. 'full_at') - late_ms) then
            recent[p] = recent[p] + held[j]
          end
        end
      end
    end
  end
  for _, p in ipairs(BUCKETS) do lift(p, recent[p]) end
  if lifts['t_'] then
    refund_window_start(get('t_boundary'), get('t_limit') - recent['t_'], get('t_sent'), get('t_refunded'),
      get('t_boundary') + math.floor(get('t_max_reset')))
  end
end

local function line_cost(tokens, out)
  local ratio = get('usage_ratio')
  if ratio <= 0 then ratio = 1 end
  ratio = math.min(math.max(ratio, 0.05), 1)
  local input, output = tokens, tokens
  if out > 0 then output = math.min(out, tokens) end
  input = tokens - output
  local kept = ratio + (1 - ratio) * (1 - refund_share(1))
  return math.ceil(input + output * kept)
end

-- An owed answer (model.rs, owed): {1, ms, reason, eta_ms}, paid in full, jittered up.
local function owed(ms, reason, u)
  local base = math.max(math.ceil(ms), 1)
  local jitter = math.min(base * jitter_frac, jitter_max) * math.min(math.max(u, 0), 1)
  hist('w', 1)
  local due = math.ceil(base + jitter)
  return {1, due, reason, due}
end

local function tenant_entry(t)
  if S['tw:' .. t] == nil then S['tw:' .. t] = 0 end
end
