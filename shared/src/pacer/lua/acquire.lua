-- A call just cleared keeps the sent ledgers as they stand with its charge in them.
-- (A function of its own, as turns_ahead and in_flight are: Lua 5.1 lets a function
-- reach at most 60 locals of the script around it, and acquire is near that.)
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

-- An ask for reservation a[1]: a[2] tokens, [3] requests, [4] jitter_u, [5] 'companion' |
-- 'work', [6] tenant weight, [7] tenant cap (0 none), [8] tenant, [9] output tokens reserved.
local function acquire(a)
  local id = a[1]
  local tokens, requests, u = tonumber(a[2]), tonumber(a[3]), tonumber(a[4])
  local companion = a[5] == 'companion'
  local weight, cap, tenant = tonumber(a[6]), tonumber(a[7]), a[8]
  local output = tonumber(a[9])
  local fl = floor_work
  if companion then fl = floor_companion end
  -- Everything below charges what the provider will charge: the input part
  -- at the learned input ratio (an estimate that does not split is taken as is).
  local raw_input = 0
  if output > 0 then
    raw_input = tokens - math.min(output, tokens)
    if get('input_ratio') > 0 then
      tokens = math.ceil(raw_input * get('input_ratio')) + math.min(output, tokens)
    end
  end
  expire()
  local rec = F[id] or waiter_of(id)
  -- 1. Asked again for a call already cleared (a redelivery): still clear.
  if rec and rec[KIND] == 'f' then
    return {0}
  end
  local waiter = nil
  if rec and rec[KIND] == 'w' then waiter = rec end
  -- 2. Back before its time: owed the rest.
  if waiter and now < waiter[DUE] then
    hist('w', 1)
    return {1, waiter[DUE] - now, waiter[REASON]}
  end
  ensure_configured()
  -- What the call costs in each bucket: the whole estimate, a request, its input, its output reservation.
  local out_part = math.min(output, tokens)
  local costs = {tokens, requests, tokens - out_part, out_part}

  -- The least place of a work turn in line, found with the turns ahead (step 5).
  local least_ahead = nil
  -- Clears the call; `order` and `line` are its place and line cost when it
  -- stood in line (nil for a probe, which no tenant's share is charged for).
  local function admit(order, line)
    local r = {'f', 0, 0, 0, get('t_refunded'), now + ttl, raw_input, 0, 1, 0, 0, get('o_refunded'), 0, 0, 0}
    -- A call cleared within BURST_GAP_MS of the last one: neither is alone.
    if now - get('last_admit') < BURST_GAP_MS then
      r[ALONE] = 0
      local prev_id = last_admit_id
      if prev_id then
        local prev = F[prev_id]
        if prev and prev[KIND] == 'f' and prev[ALONE] == 1 then
          prev[ALONE] = 0
          put(prev_id, prev)
        end
      end
    end
    for i, p in ipairs(BUCKETS) do
      if known(p) then
        local cost = costs[i]
        advance(p)
        S[p .. 'level'] = get(p .. 'level') - cost
        S[p .. 'inflight'] = get(p .. 'inflight') + cost
        S[p .. 'charged_since'] = get(p .. 'charged_since') + cost
        S[p .. 'sent'] = get(p .. 'sent') + cost
        r[HELD_FIELDS[i]] = cost
      end
    end
    if known('t_') then r[OUTPUT] = output end
    stamp_sent(r)
    put(id, r)
    if order then
      tenant_entry(tenant)
      S['tadm:' .. tenant] = get('tadm:' .. tenant) + line
    end
    if not companion and order then
      -- The least place among the work turns still in line: read with the turns
      -- ahead (one of a lower place than this turn's would be among them).
      local v = order
      if least_ahead and least_ahead < v then v = least_ahead end
      S['fair_time'] = math.max(get('fair_time'), v)
    end
    S['last_admit'] = now
    last_admit_id, last_admit_changed = id, true
    hist('a', tokens)
    return {0}
  end

  local function hold_place(ms, reason)
    local uu = 0
    if waiter then uu = u end
    local r = owed(ms, reason, uu)
    if waiter then
      waiter[DUE] = now + r[2]
      waiter[CLEAR] = math.max(waiter[CLEAR], waiter[DUE])
      waiter[REASON] = reason
      put_waiter(id, waiter)
    end
    return r
  end

  -- 3. A window a 429 closed, or a probe out.
  if now < get('blocked_until') then
    return hold_place(get('blocked_until') - now, 2)
  end
  if not any_known() then
    -- No headers, nothing configured, no 429 yet: no proactive pacing.
    if get('headerless') == 1 then return admit(nil, nil) end
    if now < get('probe_until') then
      return hold_place(math.min(get('probe_until') - now, probe_wait), 3)
    end
    S['probe_until'] = now + math.min(PROBE_HOLD_MS, ttl)
    return admit(nil, nil)
  end
  lift_all()
  -- 4. Its place in line.
  local line = line_cost(tokens, output)
  local order
  if waiter then
    waiter[LINE] = line
    order = waiter[ORDER]
  else
    tenant_entry(tenant)
    -- A cap is a share of the token bucket (or, split, of the input bucket).
    local cb = 't_'
    if not known('t_') then cb = 'i_' end
    if known(cb) and cap > 0 and share_rate(cb) > 0 then
      local due = get('tc:' .. tenant)
      if due > now then
        return owed(due - now, 4, 0)
      end
      S['tc:' .. tenant] = now + math.ceil(line / (share_rate(cb) * cap))
    end
    S['tw:' .. tenant] = weight
    order = math.max(get('fair_time'), get('tf:' .. tenant))
    S['tf:' .. tenant] = order + line / math.max(weight, 0.001)
    -- A companion turn goes first in line; its tokens count in its tenant's cap
    -- and share as a work turn's do (model.rs, fresh_place).
    if companion then order = COMPANION_BASE + now end
  end
  -- 5. Clear if the bucket holds the turns ahead and this one above the floor.
  -- The turns ahead of it: the waiters before it by place, then id, found
  -- without putting it in line (a turn cleared now never stands in it; one that
  -- waits is put there by put_waiter).
  -- What the turns ahead hold of each bucket: their line cost, their requests,
  -- their input, the output they keep.
  local ahead, other, last_clear
  ahead, other, last_clear, least_ahead = turns_ahead(id, order, tenant)
  local wait, fits = 0, true
  -- The head may go to find a window's next reset when nothing else holds it
  -- and no call cleared since the last reset will bring it (one in flight for
  -- longer than a few late_ms may never: its worker died).
  local head = ahead[1] <= 0 and ahead[2] <= 0 and ahead[3] <= 0 and ahead[4] <= 0
  local probe = head
  local answering = now - PROBE_AFTER_LATE * late_ms
  local share_now = refund_share(0)
  local flights_n, coming, wave, outputs_flying, holding, answered = in_flight(share_now, answering)
  if answered then probe = false end
  local idle = flights_n == 0 and now - get('last_admit') >= BURST_GAP_MS
  local share_known = refund_share(-1) >= 0
  local shorts = {0, 0, 0, 0}
  local deep = waits_whole()
  for i, p in ipairs(BUCKETS) do
    if known(p) then
      advance(p)
      local short = ahead[i] + need(p, costs[i], floor_at(p, fl)) - get(p .. 'level')
      if short > 0 then
        fits = false
        shorts[i] = short
        wait = math.max(wait, refill_ms(p, short, deep))
        probe = probe and may_probe(p)
      end
    end
  end
  -- Only the token bucket holds the turn.
  local tokens_only = shorts[1] > 0 and shorts[2] <= 0 and shorts[3] <= 0 and shorts[4] <= 0
  -- A window whose refunds are not known and whose head is held only by
  -- them: once per window, when every call has settled, the head goes alone.
  if not fits and head and idle and not share_known and get('t_refill') == 2 and get('t_full_at') > now
    and (get('t_probed') == 0 or get('t_probed') < get('t_boundary')) and tokens_only and shorts[1] <= get('t_withheld') then
    S['t_probed'] = now
    fits = true
  end
  if not fits and probe then
    for _, p in ipairs(BUCKETS) do
      if known(p) and may_probe(p) then S[p .. 'probed'] = now end
    end
    fits = true
  end
  if fits then return admit(order, line) end
  -- 6. Otherwise wait in line until the refill brings it — for at most three
  --    quarters of that, or a few turns' refill when that is longer — and no later
  --    than the turns ahead are predicted clear (plus late_ms).
  local reason = 1
  if other then reason = 4 end
  local turns = 0
  if known('t_') then turns = RECHECK_TURNS * line / share_rate('t_') end
  local recheck = math.min(math.max(turns, recheck_min), max_pace)
  -- Short of what the calls in flight give back: about one call's time (model.rs,
  -- answer_recheck).
  local answered = recheck
  if get('call_ms') > 0 then answered = math.min(math.max(get('call_ms'), ANSWER_RECHECK_MIN_MS), recheck) end
  -- A wait within RECHECK_TAIL horizons is slept whole, but a headerless bucket's; with
  -- whole_waits, every wait (`pull` re-times the waiters near the head).
  local sleep = wait
  if not deep and (get('headerless') == 1 or wait > recheck * RECHECK_TAIL) then
    sleep = math.min(wait, math.max(wait * RECHECK_SHARE, recheck))
  end
  -- Behind others, a whole wait errs late: the pull-ins re-time it near the head.
  if deep and not head then sleep = sleep * (1 + WHOLE_WAIT_MARGIN) end
  sleep = math.min(sleep, max_pace)
  -- A wait predicted before the shape is known, or before any call settled:
  -- be back within the recheck horizon.
  local unknown_shape = get('usage_ratio') <= 0
  for _, p in ipairs(BUCKETS) do
    if known(p) and get(p .. 'refill') == 0 then unknown_shape = true end
  end
  if unknown_shape then sleep = math.min(sleep, recheck) end
  -- A bucket learned without headers at its first 429, while the answers of its wave
  -- still lift it (model.rs, learn_headerless).
  if wave and get('headerless') == 1 and get('hl_prev_span') > 0 then sleep = math.min(sleep, recheck_min) end
  -- Likewise a window short of no more than the calls in flight hold on it, or than its
  -- floor, which shrinks to the boundary.
  for i, p in ipairs(BUCKETS) do
    if get(p .. 'refill') == 2 and shorts[i] > 0 then
      if holding[i] >= shorts[i] then
        sleep = math.min(sleep, answered)
      elseif shorts[i] <= floor_at(p, fl) * get(p .. 'limit') then
        sleep = math.min(sleep, recheck)
      end
    end
  end
  -- A window's head held only by refunds whose share is not known yet: back when the
  -- calls in flight are answered, to go alone as the refund probe.
  if head and not share_known and get('t_refill') == 2 and tokens_only
    and shorts[1] <= get('t_withheld') + outputs_flying then
    sleep = math.min(sleep, answered)
  end
  -- A window gives nothing back before its boundary but refunds: when the calls
  -- in flight are expected to give back what the turn is short of, be back soon.
  if get('t_refill') == 2 and share_now > 0 and tokens_only and coming >= shorts[1] then
    sleep = math.min(sleep, answered)
  end
  if last_clear > 0 then sleep = math.min(sleep, last_clear + late_ms - now) end
  local r = owed(math.max(sleep, 1), reason, u)
  if not waiter then
    waiter = {'w', 0, 0, 0, order, line, 0, 0, now, 0, tenant}
    tenant_entry(tenant)
    S['twait:' .. tenant] = get('twait:' .. tenant) + 1
  end
  waiter[TOKENS], waiter[REQUESTS], waiter[OUTPUT] = tokens, requests, output
  waiter[DUE] = now + r[2]
  waiter[CLEAR] = now + math.max(math.ceil(wait), r[2])
  waiter[REASON] = reason
  put_waiter(id, waiter)
  return r
end


-- model.rs, pull_in: the first k waiters in line (not past their due time by late_ms)
-- whose wait, predicted now (+ PULL_IN_PAD_MS), ends more than PULL_IN_GAIN_MS and the
-- jitter's most before their due time are moved up to it. -> {id, due_ms, ...}
local function pull_in(k)
  local out = {}
  if whole_waits ~= 1 then return out end
  expire()
  if not waits_whole() or S['nw'] <= 0 or now < get('blocked_until') or not any_known() then return out end
  for _, p in ipairs(BUCKETS) do
    if known(p) then advance(p) end
  end
  local okept = output_kept()
  local held_until = now - late_ms
  local ahead = {0, 0, 0, 0}
  local taken, start = 0, 0
  while taken < k do
    local ids, last
    if start == 0 and head_ids then
      -- The head read (op `head`), as this script changed it: the line's first waiters.
      ids, last = {unpack(head_ids)}, head_bound == nil
    else
      ids = redis.call('ZRANGE', line_key, start, start + 2 * k - 1)
      last = #ids < 2 * k
      read_waiters(ids, 1, #ids)
    end
    if #ids == 0 and last then break end
    start = start + #ids
    for _, wid in ipairs(ids) do
      local w = Wc[wid]
      if w and w[DUE] >= held_until and taken < k then
        taken = taken + 1
        local wout = math.min(w[OUTPUT], w[TOKENS])
        local costs = {w[TOKENS], w[REQUESTS], w[TOKENS] - wout, wout}
        local fl = floor_work
        if w[ORDER] < 0 then fl = floor_companion end
        local wait = 0
        for i, p in ipairs(BUCKETS) do
          if known(p) then
            local short = ahead[i] + need(p, costs[i], floor_at(p, fl)) - get(p .. 'level')
            wait = math.max(wait, refill_ms(p, short, true))
          end
        end
        local due = now + math.max(math.ceil(wait), 1) + PULL_IN_PAD_MS
        if due + PULL_IN_GAIN_MS + jitter_max < w[DUE] then
          w[DUE] = due
          w[CLEAR] = math.min(w[CLEAR], due)
          put_waiter(wid, w)
          out[#out + 1] = wid
          out[#out + 1] = due
        end
        local h1, h2, h3, h4 = holds(w, okept)
        ahead[1], ahead[2], ahead[3], ahead[4] = ahead[1] + h1, ahead[2] + h2, ahead[3] + h3, ahead[4] + h4
      end
    end
    if last then break end
  end
  return out
end
