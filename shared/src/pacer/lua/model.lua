-- model.rs
-- Drops the calls past their reservation's TTL (waiters lapse where they are read).
-- Once per `now`: what an op of the same batch puts lapses later (TTL > 0).
local expired_at = nil
local function expire()
  if expired_at == now and ttl > 0 and grace >= 0 then return end
  expired_at = now
  for id, r in pairs(F) do
    if r[EXPIRY] <= now then
      local held = {r[TOKENS], r[REQUESTS], r[IH], r[OH]}
      for i, p in ipairs(BUCKETS) do S[p .. 'inflight'] = math.max(get(p .. 'inflight') - held[i], 0) end
      drop(id)
    end
  end
  -- (Waiters lapse where they are read: live_waiter.)
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
          if lifts[p] and f[EXPIRY] - ttl >= get(p .. 'full_at') - late_ms then recent[p] = recent[p] + held[j] end
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

local function owed(ms, reason, u)
  local base = math.max(math.ceil(ms), 1)
  local jitter = math.min(base * jitter_frac, jitter_max) * math.min(math.max(u, 0), 1)
  hist('w', 1)
  return {1, math.ceil(base + jitter), reason}
end

local function tenant_entry(t)
  if S['tw:' .. t] == nil then S['tw:' .. t] = 0 end
end

-- What acquire reads of the line and the calls in flight (acquire.lua).
-- A call just cleared keeps the sent ledgers as they stand with its charge in them.
-- (Steps and helpers are functions of their own: Lua 5.1 lets a function reach at most
-- 60 locals of the script around it.)
local function stamp_sent(r)
  r[SENT] = get('t_sent')
  r[RSENT], r[ISENT], r[OSENT] = get('r_sent'), get('i_sent'), get('o_sent')
end

-- The share of its output reservation a waiter is expected to keep (model.rs, output_kept).
local function output_kept()
  local k = get('usage_ratio')
  if k > 0 then return math.min(math.max(k, 0.05), 1) end
  return 1
end

-- What waiter `w` holds for the turns behind it, per bucket (model.rs, Waiter::holds): its
-- line cost, its requests, its input, the output it keeps (`okept`: output_kept()).
local function holds(w, okept)
  local wout = math.min(w[OUTPUT], w[TOKENS])
  return w[LINE], w[REQUESTS], w[TOKENS] - wout, wout * okept
end

-- What the turns ahead of `id` (at `order`, of `tenant`) in line hold of each bucket:
-- their line cost, their requests, their input, the output they keep (the waiters
-- before it by place, then id, found without putting it in line: a turn cleared now
-- never stands in it; one that waits is put there by put_waiter); whether another
-- tenant's work turn is among them; the latest time one of them is predicted clear; and
-- the least place of a work turn in line at or before `order` (none: `order` is the least).
local function turns_ahead(id, order, tenant)
  local okept = output_kept()
  local a1, a2, a3, a4 = 0, 0, 0, 0
  local other, last_clear, least = false, 0, nil
  local held_until = now - late_ms
  each_waiter_upto(order, function(wid, w)
    if wid == id then return end
    local o = w[ORDER]
    if o >= 0 and (not least or o < least) then least = o end
    if (o < order or (o == order and wid < id)) and w[DUE] >= held_until then
      local h1, h2, h3, h4 = holds(w, okept)
      a1, a2, a3, a4 = a1 + h1, a2 + h2, a3 + h3, a4 + h4
      if o >= 0 and w[TENANT] ~= tenant then other = true end
      if w[CLEAR] > last_clear then last_clear = w[CLEAR] end
    end
  end)
  local ahead = {a1, a2, a3, a4}
  return ahead, other, last_clear, least
end

-- The calls in flight: how many; the output they are expected to give back (at the
-- refund share `share_now`); the output they reserve; what they hold of each bucket;
-- whether one was cleared at or before the headerless bucket's last cut (`wave`); and
-- whether one cleared since its bucket's last boundary, and since `answering`, may
-- still bring that boundary (then the head does not go as a probe).
local function in_flight(share_now, answering)
  local flights_n, coming, wave, outputs_flying = 0, 0, false, 0
  local holding = {0, 0, 0, 0}
  local answered = false
  local kept = get('usage_ratio')
  if kept <= 0 then kept = 1 end
  kept = math.min(math.max(kept, 0), 1)
  -- (What the loop compares with, read once: the loop runs for every call in flight.)
  local hl_cut = get('hl_cut')
  local answered_since = {}
  for j, p in ipairs(BUCKETS) do
    if known(p) then answered_since[j] = math.max(get(p .. 'boundary'), answering) end
  end
  local a1, a2, a3, a4 = answered_since[1], answered_since[2], answered_since[3], answered_since[4]
  for _, f in pairs(F) do
    flights_n = flights_n + 1
    coming = coming + f[OUTPUT] * (1 - kept) * share_now
    outputs_flying = outputs_flying + f[OUTPUT]
    local cleared = f[EXPIRY] - ttl
    if cleared <= hl_cut then wave = true end
    holding[1] = holding[1] + f[TOKENS]
    holding[2] = holding[2] + f[REQUESTS]
    holding[3] = holding[3] + f[IH]
    holding[4] = holding[4] + f[OH]
    if not answered and ((a1 and cleared >= a1) or (a2 and cleared >= a2) or (a3 and cleared >= a3)
      or (a4 and cleared >= a4)) then
      answered = true
    end
  end
  return flights_n, coming, wave, outputs_flying, holding, answered
end
