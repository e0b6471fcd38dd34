-- settle.rs: a finished call's report corrects the model, in the same named steps.

-- Step 1: the reservation leaves the model; what it held, and what the report corrects
-- (settle.rs, take_reservation). A call's report for reservation a[1]: [2] used_tokens
-- (-1 unknown), [3] rate_limited_ms (-1 none), [4..6] token limit, remaining, reset_ms,
-- [7..9] same for requests (-1 missing), [10] headers_age_ms, [11] input tokens the
-- provider counted (-1 unknown), [12..14] input bucket limit, remaining, reset_ms, [15..17]
-- same for the output bucket.
local function take_reservation(a)
  local id = a[1]
  local r = {used = tonumber(a[2]), limited = tonumber(a[3]), counted = tonumber(a[11])}
  r.tk, r.out, r.estimated_input, r.sent_mark = 0, 0, 0, 0
  r.held = {0, 0, 0, 0}
  local rec = F[id] or waiter_of(id)
  if rec and rec[KIND] == 'f' then
    r.rec = rec
    r.tk, r.out, r.mark, r.estimated_input, r.sent_mark = rec[TOKENS], rec[OUTPUT], rec[MARK], rec[INPUT], rec[SENT]
    r.held = {rec[TOKENS], rec[REQUESTS], rec[IH], rec[OH]}
    r.cleared_at = rec[EXPIRY] - ttl
    -- Released and given back before its worker started it: it reached no provider,
    -- and never entered the ledgers.
    r.unsent = rec[STARTED] ~= 1
  end
  drop(id)
  if r.unsent then count_unsent() end
  -- A probe (or any call) that settled: the next probe may go.
  if r.mark then S['probe_until'] = 0 end
  local output = r.tk
  if r.out > 0 then output = math.min(r.out, r.tk) end
  r.input, r.output = r.tk - output, output
  -- What the reservation was off by: its input part (the provider charged the
  -- input it counted), and the output left unused (given back in the learned share).
  r.input_fix, r.unused = 0, 0
  local used, counted, held = r.used, r.counted, r.held
  if r.limited < 0 and used >= 0 then
    if counted >= 0 and r.out > 0 then
      r.input_fix, r.unused = r.input - counted, math.max(counted + output - used, 0)
    else
      r.unused = math.max(r.tk - used, 0)
    end
  end
  -- The separate input and output buckets: the input charged as the provider counted
  -- it; the output reservation's unused part given back when the answer is done.
  r.in_fix, r.out_unused = 0, 0
  if counted >= 0 and held[3] > 0 then r.in_fix = held[3] - counted end
  if r.limited < 0 and used >= 0 and counted >= 0 and held[4] > 0 then
    r.out_unused = math.max(held[4] - (used - counted), 0)
  end
  r.headers_at = now - tonumber(a[10])
  r.obs = {
    {tonumber(a[4]), tonumber(a[5]), tonumber(a[6])},
    {tonumber(a[7]), tonumber(a[8]), tonumber(a[9])},
    {tonumber(a[12]), tonumber(a[13]), tonumber(a[14])},
    {tonumber(a[15]), tonumber(a[16]), tonumber(a[17])},
  }
  return r
end

-- Step 2: the ratios an answered call teaches (settle.rs, learn_usage).
local function learn_usage(r)
  if r.limited >= 0 then return end
  local used, counted = r.used, r.counted
  if counted >= 0 and r.estimated_input > 0 then
    local seen = math.min(math.max(counted / r.estimated_input, 0.25), 4)
    local prior = get('input_ratio')
    if prior <= 0 then
      -- The first count taken whole, within a factor of 2 (settle.rs, INPUT_RATIO_FIRST_BAND).
      seen = math.min(math.max(seen, 0.5), 2)
      prior = seen
    end
    -- One count moves the ratio a step at most (settle.rs, INPUT_RATIO_STEP = 1.25).
    seen = math.min(math.max(seen, prior / 1.25), prior * 1.25)
    S['input_ratio'] = 0.7 * prior + 0.3 * seen
  end
  if r.mark then
    -- An answered call's time, clearance to settle: the first taken whole.
    local seen = math.max(now - r.cleared_at, 0)
    local prior = get('call_ms')
    if prior <= 0 then prior = seen end
    S['call_ms'] = 0.8 * prior + 0.2 * seen
  end
  if used >= 0 then
    -- The output reservation: on the combined bucket, or (split) on the output bucket.
    local u_input, u_output = r.input, r.output
    if r.mark and r.tk == 0 and r.held[4] > 0 then u_input, u_output = r.held[3], r.held[4] end
    if counted >= 0 then u_input = counted end
    if u_output > 0 then
      local seen = math.min(math.max((used - u_input) / u_output, 0), 1)
      local prior = get('usage_ratio')
      if prior <= 0 then prior = math.max(seen, 0.05) end
      S['usage_ratio'] = 0.8 * prior + 0.2 * seen
    end
  end
end

-- Step 4: what the headers cannot show (settle.rs, unseen_by_headers): what others left
-- unused since this call was sent, what was cleared after it (only calls cleared later
-- than a burst of it are surely not in its headers), and what was cleared after it and
-- has settled already (in the ledgers, no longer in flight).
local function unseen_by_headers(r)
  local u = {share = refund_share(0), others = 0, others_out = 0}
  u.after, u.settled_after = {0, 0, 0, 0}, {0, 0, 0, 0}
  -- With no bucket known every call in flight holds nothing: the scans below would add
  -- zeros (a provider without headers or limits, where each settle counts).
  r.scan = any_known()
  if not r.mark then return u end
  local rec, after = r.rec, u.after
  u.others = math.max(get('t_refunded') - r.mark, 0)
  u.others_out = math.max(get('o_refunded') - rec[OMARK], 0)
  local later = {0, 0, 0, 0}
  if r.scan then
    local e = rec[EXPIRY]
    for _, g in pairs(F) do
      if g[EXPIRY] > e then
        later[1], later[2], later[3], later[4] =
          later[1] + g[TOKENS], later[2] + g[REQUESTS], later[3] + g[IH], later[4] + g[OH]
      end
      -- (What the line released and no worker has sent yet is in no headers.)
      if g[STARTED] ~= 1 or g[EXPIRY] - e > BURST_GAP_MS then
        after[1], after[2], after[3], after[4] =
          after[1] + g[TOKENS], after[2] + g[REQUESTS], after[3] + g[IH], after[4] + g[OH]
      end
    end
  end
  local marks = {rec[SENT], rec[RSENT], rec[ISENT], rec[OSENT]}
  for j, p in ipairs(BUCKETS) do
    u.settled_after[j] = math.max(get(p .. 'sent') - marks[j] - later[j], 0)
  end
  return u
end

-- The calls in flight as a list (empty when no bucket is known: see unseen_by_headers).
local function flight_list(r)
  local flights = {}
  if r.scan then
    for _, g in pairs(F) do flights[#flights + 1] = g end
  end
  return flights
end

-- Step 5: a window whose boundary went by while no headers named it (settle.rs,
-- boundary_from_headers): the first headers from the window that began name the next
-- boundary, a window later; the bucket was full at the one between, less what was
-- cleared since (this call among them).
local function boundary_from_headers(r, flights)
  for j, p in ipairs(BUCKETS) do
    local reset = r.obs[j][3]
    local window = get(p .. 'max_reset')
    if get(p .. 'refill') == WINDOW and reset >= 0 then
      local start = r.headers_at + reset - math.floor(window)
      if window > 0 and get(p .. 'full_at') <= now and start <= now and start > get(p .. 'boundary') + window / 2 then
        local since = start - late_ms
        local recent = 0
        for _, g in ipairs(flights) do
          local gh = {g[TOKENS], g[REQUESTS], g[IH], g[OH]}
          if g[STARTED] ~= 1 or g[EXPIRY] - ttl >= since then recent = recent + gh[j] end
        end
        if r.cleared_at and r.cleared_at >= since then recent = recent + r.held[j] end
        advance(p)
        S[p .. 'level'] = math.max(get(p .. 'level'), get(p .. 'limit') - recent)
        S[p .. 'boundary'] = start
        S[p .. 'charged_since'] = 0
      end
    end
  end
end

-- How high a refund can have lifted each bucket (settle.rs, refund_cap): its limit,
-- plus the refill since a moment after this call was cleared, less what was cleared
-- after that moment, at the least over the moments the calls in flight were cleared.
local function refund_caps(r, flights)
  local caps = {1e308, 1e308, 1e308, 1e308}
  local cleared_at = r.cleared_at
  if not cleared_at then return caps end
  for j, p in ipairs(BUCKETS) do
    if known(p) then
      local since = cleared_at
      if get(p .. 'refill') == WINDOW then since = math.max(cleared_at, get(p .. 'boundary') - late_ms) end
      -- The calls cleared later, newest first; those cleared at one moment count
      -- together (the least falls on the last of them, whatever their order).
      local field = HELD_FIELDS[j]
      local sums, ats = {}, {}
      for _, g in ipairs(flights) do
        local at, x = g[EXPIRY] - ttl, g[field]
        if g[STARTED] ~= 1 then at = now end
        if at > since and x > 0 then
          if sums[at] then
            sums[at] = sums[at] + x
          else
            sums[at] = x
            ats[#ats + 1] = at
          end
        end
      end
      table.sort(ats)
      local rate, after, limit = refill_rate(p), 0, get(p .. 'limit')
      local cap = limit
      for k = #ats, 1, -1 do
        local at = ats[k]
        after = after + sums[at]
        cap = math.min(cap, limit + rate * math.max(now - at, 0) - after)
      end
      caps[j] = cap
    end
  end
  return caps
end

-- Step 6: each bucket gets back what the reservation held beyond the charge
-- (settle.rs, credit_reservation): the input fix, the unused output at the share
-- credited (the output bucket gives it all back), no higher than a refund can have
-- lifted it, and what of it is withheld (the part not credited).
local function credit_reservation(r, share, flights)
  local caps = refund_caps(r, flights)
  -- A call cleared just before a window's boundary was charged to the new window at
  -- its lift; its headers tell which window it went into.
  local old_window = {false, false, false, false}
  if r.mark then
    local cleared = r.cleared_at
    for j, p in ipairs(BUCKETS) do
      local b = get(p .. 'boundary')
      if get(p .. 'refill') == WINDOW and r.obs[j][3] >= 0 and cleared < b and cleared >= b - late_ms
        and r.headers_at + r.obs[j][3] < b + get(p .. 'max_reset') / 2 then
        old_window[j] = true
      end
    end
  end
  local held, unused = r.held, r.unused
  local per = {
    {held[1], r.input_fix, unused, share, unused * math.max(1 - share, 0)},
    {held[2], 0, 0, 0, 0},
    {held[3], r.in_fix, 0, 0, 0},
    {held[4], 0, r.out_unused, 1, 0},
  }
  for j, p in ipairs(BUCKETS) do
    local h, fix, u, sh, withhold = per[j][1], per[j][2], per[j][3], per[j][4], per[j][5]
    if old_window[j] and r.limited < 0 then
      S[p .. 'level'] = math.min(get(p .. 'level') + h, math.max(get(p .. 'limit'), get(p .. 'level')))
    end
    advance(p)
    S[p .. 'inflight'] = math.max(get(p .. 'inflight') - h, 0)
    -- A refused call's whole reservation comes back, to us and to the ledger; one never
    -- sent, to us alone.
    if r.limited >= 0 or r.unsent then fix = h end
    credit(p, fix)
    credit_refund(p, sh * u, caps[j])
    if not r.unsent then S[p .. 'sent'] = get(p .. 'sent') - fix end
    S[p .. 'refunded'] = get(p .. 'refunded') + u
    if withhold > 0 then S[p .. 'withheld'] = get(p .. 'withheld') + withhold end
    cap_withheld(p)
  end
end

-- Step 7: each bucket's headers lower the model (settle.rs, observe_headers), with what
-- changed at the provider since they were sent and what this call was charged there.
local function observe_headers(r, u)
  local after = u.after
  local since = {u.share * (r.unused + u.others) - after[1], -after[2], -after[3],
    r.out_unused + u.others_out - after[4]}
  for j, p in ipairs(BUCKETS) do
    local own = r.held[j]
    if r.limited >= 0 then own = 0 end
    local unseen = 0
    if j == 1 then unseen = r.unused + u.others end
    local o = r.obs[j]
    observe(p, o[1], o[2], o[3], r.headers_at, since[j], own, u.settled_after[j], unseen)
  end
end

-- Step 8: the refund learner takes the answer's token headers (from a call cleared
-- alone); once the share is known, the refunds withheld while it was not are credited
-- as the newest headers confirm them (settle.rs, learn_refund_share). (A limit inferred
-- from remaining alone learns nothing here.)
local function learn_refund_share(r)
  local t_limit, t_remaining, t_reset = r.obs[1][1], r.obs[1][2], r.obs[1][3]
  if not (r.mark and t_limit >= 0 and t_remaining >= 0 and known('t_') and t_limit == get('t_limit')
    and t_reset <= max_pace) then
    return
  end
  local headers_at, sent_mark = r.headers_at, r.sent_mark
  local remaining = math.min(t_remaining, t_limit)
  local newest = headers_at > get('rs_seen')
  S['rs_seen'] = math.max(get('rs_seen'), headers_at)
  if r.rec[ALONE] == 1 then
    -- A pair must not span the reset these headers name, unless the bucket is known continuous.
    local until_ms = 0
    if get('t_refill') ~= CONTINUOUS and t_reset >= 0 then until_ms = headers_at + t_reset end
    -- A refused call was charged nothing: its own charge is not in its headers.
    local sent = sent_mark
    if r.limited >= 0 then sent = sent_mark - r.tk end
    refund_learn(headers_at, remaining, sent, r.mark, until_ms)
  end
  local known_share = refund_share(-1)
  -- (A share of nought drops nothing withheld: settle.rs, learn_refund_share.)
  if r.limited >= 0 or known_share < 0 or not newest or get('t_withheld') <= 0 then return end
  advance('t_')
  local elapsed = math.max(now - headers_at, 0)
  local pending = 0
  for _, o in pairs(F) do
    if o[SENT] < sent_mark then pending = pending + o[TOKENS] else pending = pending + o[OUTPUT] end
  end
  local theirs = math.min(remaining + known_share * r.unused + refill_rate('t_') * elapsed, get('t_limit'))
    - math.max(get('t_sent') - sent_mark, 0) - pending
  local owed_credit = math.min(get('t_withheld'), math.max(theirs - get('t_level'), 0))
  -- Not credit(): these refunds came before the headers that set the reset.
  S['t_level'] = math.min(get('t_level') + owed_credit, math.max(get('t_limit'), get('t_level')))
  S['t_withheld'] = math.max(get('t_withheld') - owed_credit, 0)
end

-- The bucket of a budget without headers, learned from its 429s (settle.rs, learn_headerless).
local function learn_headerless(r)
  local cleared = r.cleared_at
  if get('hl_since') == 0 then S['hl_since'] = cleared end
  if r.limited < 0 then
    local u = r.tk
    if r.used >= 0 then u = r.used end
    S['hl_max'] = math.max(get('hl_max'), u)
    if known('t_') then advance('t_') end
    if cleared > get('hl_cut') then
      S['hl_used'] = get('hl_used') + u
    elseif get('hl_prev_span') > 0 then
      S['hl_prev'] = get('hl_prev') + u
      S['t_rate'] = math.max(get('t_rate'), HL_CUT * get('hl_prev') / get('hl_prev_span'))
      S['t_limit'] = math.max(get('t_limit'), get('t_rate') * HL_BURST_MS)
    end
    if known('t_') then
      if get('t_level') < get('t_limit') / 2 then
        local dt = math.min(math.max(now - get('hl_grow'), 0), HL_GROW_MAX_MS)
        local accel = math.min(math.max((now - get('hl_cut')) / HL_ACCEL_MS, 1), HL_ACCEL_MAX)
        S['t_rate'] = get('t_rate') * (1 + HL_GROW_PER_MS * accel * dt)
        S['t_limit'] = math.max(get('t_limit'), get('t_rate') * HL_BURST_MS)
      end
    end
    S['hl_grow'] = now
  elseif cleared > get('hl_cut') and get('hl_max') > 0 then
    local span = math.max(now - get('hl_since'), 1)
    local rate, prev_span
    if known('t_') then
      rate = math.min(math.max(HL_CUT * get('hl_used') / span, HL_CUT_MIN * get('t_rate')), HL_CUT * get('t_rate'))
      prev_span = 0
    else
      prev_span = math.max(span, HL_FIRST_SPAN_MS)
      rate = HL_CUT * get('hl_used') / prev_span
    end
    rate = math.max(rate, get('hl_max') / 60000)
    local limit = math.max(rate * HL_BURST_MS, 2 * get('hl_max'))
    if known('t_') then
      advance('t_')
      S['t_rate'], S['t_limit'] = rate, limit
      S['t_level'] = math.min(get('t_level'), 0)
    else
      fresh_bucket('t_', limit, rate, 0)
    end
    S['hl_prev'], S['hl_prev_span'] = get('hl_used'), prev_span
    S['hl_used'], S['hl_since'], S['hl_cut'], S['hl_grow'] = 0, now, now, now
  end
end

-- Step 9: headers seen; or, answered without them while nothing is configured, no
-- proactive pacing until a 429 teaches a bucket (settle.rs, note_headers).
local function note_headers(r)
  local obs = r.obs
  if obs[1][2] >= 0 or obs[2][2] >= 0 or obs[3][2] >= 0 or obs[4][2] >= 0 then
    S['observed_at'] = now
    S['probe_until'] = 0
    S['headerless'] = 0
  elseif r.mark and not any_known() then
    S['headerless'] = 1
  end
  if get('headerless') == 1 and r.mark then learn_headerless(r) end
end

-- Step 10: a 429 closes the window for every worker (settle.rs, close_window).
local function close_window(r)
  if r.limited < 0 then return end
  hist('r', 1)
  S['blocked_until'] = math.max(get('blocked_until'), r.headers_at + r.limited)
  for j, p in ipairs(BUCKETS) do
    if known(p) and r.obs[j][2] < 0 then S[p .. 'level'] = math.min(get(p .. 'level'), 0) end
  end
end

-- settle.rs, settle: refunds what a reservation held beyond what its call used, lowers
-- the model to the headers (never raises it), and on a 429 closes the window.
local function settle(a)
  expire()
  ensure_configured()
  local r = take_reservation(a)
  learn_usage(r)
  lift_all()
  local u = unseen_by_headers(r)
  local flights = flight_list(r)
  boundary_from_headers(r, flights)
  credit_reservation(r, u.share, flights)
  observe_headers(r, u)
  learn_refund_share(r)
  note_headers(r)
  close_window(r)
  return {0}
end
