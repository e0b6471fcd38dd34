-- acquire.rs: may this call go now, and if not, how long is it owed? In the same named steps.

-- Clears the call (acquire.rs, admit): it leaves the line, its reservation is charged and
-- in flight. `order` and `line` are its place and line cost when it stood in line (nil for
-- a probe, which no tenant's share is charged for).
local function admit(q, order, line)
  local id, costs = q.id, q.costs
  local r = {'f', 0, 0, 0, get('t_refunded'), now + ttl, q.raw_input, 0, 1, 0, 0, get('o_refunded'), 0, 0, 0}
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
  if known('t_') then r[OUTPUT] = q.output end
  stamp_sent(r)
  put(id, r)
  if order then
    tenant_entry(q.tenant)
    S['tadm:' .. q.tenant] = get('tadm:' .. q.tenant) + line
  end
  if not q.companion and order then
    -- The least place among the work turns still in line: read with the turns
    -- ahead (one of a lower place than this turn's would be among them).
    local v = order
    if q.least_ahead and q.least_ahead < v then v = q.least_ahead end
    S['fair_time'] = math.max(get('fair_time'), v)
  end
  S['last_admit'] = now
  last_admit_id, last_admit_changed = id, true
  hist('a', q.tokens)
  return {0}
end

-- An owed answer for something other than the line (acquire.rs, hold_place): a waiter
-- keeps its place and comes back then; a new turn does not join (and gets the exact
-- time: no jitter).
local function hold_place(q, ms, reason)
  local waiter = q.waiter
  local uu = 0
  if waiter then uu = q.u end
  local r = owed(ms, reason, uu)
  if waiter then
    waiter[DUE] = now + r[2]
    waiter[CLEAR] = math.max(waiter[CLEAR], waiter[DUE])
    waiter[REASON] = reason
    put_waiter(q.id, waiter)
  end
  return r
end

-- Step 2: a waiter back before its due time is owed the rest (acquire.rs, back_early).
local function back_early(q)
  local waiter = q.waiter
  if waiter and now < waiter[DUE] then
    hist('w', 1)
    return {1, waiter[DUE] - now, waiter[REASON]}
  end
  return nil
end

-- Step 3: a window a 429 closed, or nothing known yet: a probe, or no pacing at all
-- (acquire.rs, closed_or_unknown).
local function closed_or_unknown(q)
  if now < get('blocked_until') then
    return hold_place(q, get('blocked_until') - now, OWED_RATE_LIMITED)
  end
  if any_known() then return nil end
  -- No headers, nothing configured, no 429 yet: no proactive pacing.
  if get('headerless') == 1 then return admit(q, nil, nil) end
  if now < get('probe_until') then
    return hold_place(q, math.min(get('probe_until') - now, probe_wait), OWED_PROBE)
  end
  S['probe_until'] = now + math.min(PROBE_HOLD_MS, ttl)
  return admit(q, nil, nil)
end

-- Step 4: its place in line (acquire.rs, take_place): kept if it waited before, else
-- given now; a capped tenant's new turn first passes its cap (nil and the owed answer
-- while the cap holds it back).
local function take_place(q)
  local line = line_cost(q.tokens, q.output)
  local waiter, tenant = q.waiter, q.tenant
  if waiter then
    waiter[LINE] = line
    return {order = waiter[ORDER], line = line}
  end
  tenant_entry(tenant)
  -- A cap is a share of the token bucket (or, split, of the input bucket).
  local cb = 't_'
  if not known('t_') then cb = 'i_' end
  if known(cb) and q.cap > 0 and share_rate(cb) > 0 then
    local due = get('tc:' .. tenant)
    if due > now then
      return nil, owed(due - now, OWED_FAIR_SHARE, 0)
    end
    S['tc:' .. tenant] = now + math.ceil(line / (share_rate(cb) * q.cap))
  end
  S['tw:' .. tenant] = q.weight
  local order = math.max(get('fair_time'), get('tf:' .. tenant))
  S['tf:' .. tenant] = order + line / math.max(q.weight, 0.001)
  -- A companion turn goes first in line; its tokens count in its tenant's cap
  -- and share as a work turn's do (acquire.rs, fresh_place).
  if q.companion then order = COMPANION_BASE + now end
  return {order = order, line = line}
end

-- Step 5: clear if every bucket holds what the turns ahead hold and this turn above the
-- floor; the head may go as a probe (acquire.rs, room_for).
local function room_for(q, place)
  local room = {fits = true, wait = 0, shorts = {0, 0, 0, 0}}
  -- The turns ahead of it: the waiters before it by place, then id, found without
  -- putting it in line (a turn cleared now never stands in it; one that waits is put
  -- there by put_waiter).
  room.ahead, room.other, room.last_clear, q.least_ahead = turns_ahead(q.id, place.order, q.tenant)
  local ahead, shorts, fl = room.ahead, room.shorts, q.fl
  -- The head may go to find a window's next reset when nothing else holds it and no
  -- call cleared since the last reset will bring it (one in flight for longer than a
  -- few late_ms may never: its worker died).
  room.head = ahead[1] <= 0 and ahead[2] <= 0 and ahead[3] <= 0 and ahead[4] <= 0
  local probe = room.head
  local answering = now - PROBE_AFTER_LATE * late_ms
  room.share_now = refund_share(0)
  local flights_n, answered
  flights_n, room.coming, room.wave, room.outputs_flying, room.holding, answered = in_flight(room.share_now, answering)
  if answered then probe = false end
  local idle = flights_n == 0 and now - get('last_admit') >= BURST_GAP_MS
  room.share_known = refund_share(-1) >= 0
  local deep = waits_whole()
  for i, p in ipairs(BUCKETS) do
    if known(p) then
      advance(p)
      local short = ahead[i] + need(p, q.costs[i], floor_at(p, fl)) - get(p .. 'level')
      if short > 0 then
        room.fits = false
        shorts[i] = short
        room.wait = math.max(room.wait, refill_ms(p, short, deep))
        probe = probe and may_probe(p)
      end
    end
  end
  -- Only the token bucket holds the turn.
  room.tokens_only = shorts[1] > 0 and shorts[2] <= 0 and shorts[3] <= 0 and shorts[4] <= 0
  -- A window whose refunds are not known and whose head is held only by them: once
  -- per window, when every call has settled, the head goes alone.
  if not room.fits and room.head and idle and not room.share_known and get('t_refill') == WINDOW
    and get('t_full_at') > now and (get('t_probed') == 0 or get('t_probed') < get('t_boundary'))
    and room.tokens_only and shorts[1] <= get('t_withheld') then
    S['t_probed'] = now
    room.fits = true
  end
  if not room.fits and probe then
    for _, p in ipairs(BUCKETS) do
      if known(p) and may_probe(p) then S[p .. 'probed'] = now end
    end
    room.fits = true
  end
  return room
end

-- Step 6: it waits in line until the refill brings it — for at most three quarters of
-- that, or a few turns' refill when that is longer — and no later than the turns ahead
-- are predicted clear (plus late_ms) (acquire.rs, wait_in_line).
local function wait_in_line(q, place, room)
  local wait, shorts, head, tokens_only = room.wait, room.shorts, room.head, room.tokens_only
  local deep = waits_whole()
  local reason = OWED_BUDGET
  if room.other then reason = OWED_FAIR_SHARE end
  local turns = 0
  if known('t_') then turns = RECHECK_TURNS * place.line / share_rate('t_') end
  local recheck = math.min(math.max(turns, recheck_min), max_pace)
  -- Short of what the calls in flight give back: about one call's time (acquire.rs,
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
    if known(p) and get(p .. 'refill') == UNKNOWN then unknown_shape = true end
  end
  if unknown_shape then sleep = math.min(sleep, recheck) end
  -- A bucket learned without headers at its first 429, while the answers of its wave
  -- still lift it (settle.rs, learn_headerless).
  if room.wave and get('headerless') == 1 and get('hl_prev_span') > 0 then sleep = math.min(sleep, recheck_min) end
  -- Likewise a window short of no more than the calls in flight hold on it, or than its
  -- floor, which shrinks to the boundary.
  for i, p in ipairs(BUCKETS) do
    if get(p .. 'refill') == WINDOW and shorts[i] > 0 then
      if room.holding[i] >= shorts[i] then
        sleep = math.min(sleep, answered)
      elseif shorts[i] <= floor_at(p, q.fl) * get(p .. 'limit') then
        sleep = math.min(sleep, recheck)
      end
    end
  end
  -- A window's head held only by refunds whose share is not known yet: back when the
  -- calls in flight are answered, to go alone as the refund probe.
  if head and not room.share_known and get('t_refill') == WINDOW and tokens_only
    and shorts[1] <= get('t_withheld') + room.outputs_flying then
    sleep = math.min(sleep, answered)
  end
  -- A window gives nothing back before its boundary but refunds: when the calls
  -- in flight are expected to give back what the turn is short of, be back soon.
  if get('t_refill') == WINDOW and room.share_now > 0 and tokens_only and room.coming >= shorts[1] then
    sleep = math.min(sleep, answered)
  end
  if room.last_clear > 0 then sleep = math.min(sleep, room.last_clear + late_ms - now) end
  local r = owed(math.max(sleep, 1), reason, q.u)
  local waiter = q.waiter
  if not waiter then
    waiter = {'w', 0, 0, 0, place.order, place.line, 0, 0, now, 0, q.tenant}
    tenant_entry(q.tenant)
    S['twait:' .. q.tenant] = get('twait:' .. q.tenant) + 1
  end
  waiter[TOKENS], waiter[REQUESTS], waiter[OUTPUT] = q.tokens, q.requests, q.output
  waiter[DUE] = now + r[2]
  waiter[CLEAR] = now + math.max(math.ceil(wait), r[2])
  waiter[REASON] = reason
  put_waiter(q.id, waiter)
  return r
end

-- An ask for reservation a[1]: a[2] tokens, [3] requests, [4] jitter_u, [5] 'companion' |
-- 'work', [6] tenant weight, [7] tenant cap (0 none), [8] tenant, [9] output tokens reserved
-- (acquire.rs, acquire).
local function acquire(a)
  local q = {id = a[1], tokens = tonumber(a[2]), requests = tonumber(a[3]), u = tonumber(a[4]),
    companion = a[5] == 'companion', weight = tonumber(a[6]), cap = tonumber(a[7]), tenant = a[8],
    output = tonumber(a[9]), raw_input = 0}
  q.fl = floor_work
  if q.companion then q.fl = floor_companion end
  -- Everything below charges what the provider will charge: the input part
  -- at the learned input ratio (an estimate that does not split is taken as is).
  if q.output > 0 then
    q.raw_input = q.tokens - math.min(q.output, q.tokens)
    if get('input_ratio') > 0 then
      q.tokens = math.ceil(q.raw_input * get('input_ratio')) + math.min(q.output, q.tokens)
    end
  end
  expire()
  local rec = F[q.id] or waiter_of(q.id)
  -- 1. Asked again for a call already cleared (a redelivery): still clear.
  if rec and rec[KIND] == 'f' then return {0} end
  if rec and rec[KIND] == 'w' then q.waiter = rec end
  -- 2. Back before its time: owed the rest.
  local early = back_early(q)
  if early then return early end
  ensure_configured()
  -- What the call costs in each bucket: the whole estimate, a request, its input, its output reservation.
  local out_part = math.min(q.output, q.tokens)
  q.costs = {q.tokens, q.requests, q.tokens - out_part, out_part}
  -- 3. A window a 429 closed, or nothing known yet.
  local held = closed_or_unknown(q)
  if held then return held end
  lift_all()
  -- 4. Its place in line.
  local place, gated = take_place(q)
  if not place then return gated end
  -- 5. Clear if the bucket holds the turns ahead and this one above the floor.
  local room = room_for(q, place)
  if room.fits then return admit(q, place.order, place.line) end
  -- 6. Otherwise it waits in line.
  return wait_in_line(q, place, room)
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
