-- acquire.rs: may this call go now, and if not, where does it wait? In the same named
-- steps. A turn that must wait is parked once in line and released once (release.lua);
-- only the head of the line is weighed against the buckets.

-- (Steps and helpers are functions of their own: Lua 5.1 lets a function reach at most
-- 60 locals of the script around it.)

-- An ask as the steps read it: reservation `id` for `tokens` and `requests`, `output`
-- of them reserved for output (as the worker counts them), by `tenant`. What the
-- provider will charge: the input part at the learned input ratio (an estimate that
-- does not split is taken as is), and what that costs in each bucket (the whole
-- estimate, a request, its input, its output reservation).
local function ask_of(id, tokens, requests, output, tenant, companion)
  local q = {id = id, raw_tokens = tokens, requests = requests, output = output, tenant = tenant,
    companion = companion, raw_input = 0, tokens = tokens}
  if output > 0 then
    q.raw_input = tokens - math.min(output, tokens)
    if get('input_ratio') > 0 then
      q.tokens = math.ceil(q.raw_input * get('input_ratio')) + math.min(output, tokens)
    end
  end
  local out_part = math.min(output, q.tokens)
  q.costs = {q.tokens, requests, q.tokens - out_part, out_part}
  q.fl = floor_work
  if companion then q.fl = floor_companion end
  return q
end

-- Takes the reservation of a call admit clears, or the line releases (acquire.rs,
-- reserve): it leaves the line, its charge leaves the buckets; not sent yet (send: its
-- charge enters the ledgers then). `place` is its order and line cost when it stood in
-- line (nil for a probe, which no tenant's share is charged for).
local function reserve(q, place)
  local id, costs = q.id, q.costs
  local r = {'f', 0, 0, 0, 0, now + ttl, q.raw_input, 0, 0, 0, 0, 0, 0, 0, 0, 0}
  for i, p in ipairs(BUCKETS) do
    if known(p) then
      local cost = costs[i]
      advance(p)
      S[p .. 'level'] = get(p .. 'level') - cost
      S[p .. 'inflight'] = get(p .. 'inflight') + cost
      S[p .. 'charged_since'] = get(p .. 'charged_since') + cost
      r[HELD_FIELDS[i]] = cost
    end
  end
  if known('t_') then r[OUTPUT] = q.output end
  put(id, r)
  count_unsent()
  if place then
    tenant_entry(q.tenant)
    S['tadm:' .. q.tenant] = get('tadm:' .. q.tenant) + place.line
    -- A work turn admitted is the least in line: the virtual time moves to its tag.
    if not q.companion then S['fair_time'] = math.max(get('fair_time'), place.order) end
  end
  hist('a', q.tokens)
end

-- The reserved call `id` is sent now (acquire.rs, send): its charge enters the sent
-- ledgers, and its marks note where they stand (its own charge included); it is alone
-- unless another was sent within BURST_GAP_MS of it (then neither is); its reservation
-- lapses ttl from now.
local function send(id)
  local r = F[id]
  if not r then return end
  r[ALONE] = 1
  if now - get('last_admit') < BURST_GAP_MS then
    r[ALONE] = 0
    local prev_id = last_admit_id
    if prev_id and prev_id ~= id then
      local prev = F[prev_id]
      if prev and prev[KIND] == 'f' and prev[ALONE] == 1 then
        prev[ALONE] = 0
        put(prev_id, prev)
      end
    end
  end
  for i, p in ipairs(BUCKETS) do S[p .. 'sent'] = get(p .. 'sent') + r[HELD_FIELDS[i]] end
  r[MARK], r[OMARK] = get('t_refunded'), get('o_refunded')
  r[SENT] = get('t_sent')
  r[RSENT], r[ISENT], r[OSENT] = get('r_sent'), get('i_sent'), get('o_sent')
  r[EXPIRY], r[STARTED] = now + ttl, 1
  put(id, r)
  count_unsent()
  S['last_admit'] = now
  last_admit_id, last_admit_changed = id, true
end

-- Clears the call (acquire.rs, admit): reserved and sent now.
local function admit(q, place)
  reserve(q, place)
  send(q.id)
  return {0}
end

-- Step 2: a waiter back before its due time is owed the rest (acquire.rs, back_early).
local function back_early(q)
  local waiter = q.waiter
  if waiter and now < waiter[DUE] then
    hist('w', 1)
    return {1, waiter[DUE] - now, waiter[REASON], math.max(waiter[CLEAR] - now, 0)}
  end
  return nil
end

-- Step 4: its place in line (acquire.rs, take_place): kept if it waited before, else
-- given now; a capped tenant's new turn first passes its cap (nil and the owed answer
-- while the cap holds it back).
local function take_place(q, weight, cap)
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
  if known(cb) and cap > 0 and share_rate(cb) > 0 then
    local due = get('tc:' .. tenant)
    if due > now then
      return nil, owed(due - now, OWED_FAIR_SHARE, 0)
    end
    S['tc:' .. tenant] = now + math.ceil(line / (share_rate(cb) * cap))
  end
  S['tw:' .. tenant] = weight
  local order = math.max(get('fair_time'), get('tf:' .. tenant))
  S['tf:' .. tenant] = order + line / math.max(weight, 0.001)
  -- A companion turn goes first in line; its tokens count in its tenant's cap
  -- and share as a work turn's do (acquire.rs, fresh_place).
  if q.companion then order = COMPANION_BASE + now end
  return {order = order, line = line}
end

-- Whether a call cleared since its bucket's last boundary, and since `answering`, may
-- still bring that boundary (then the head does not go as a probe); and whether none is
-- in flight.
local function flights_since_boundary(answering)
  local since = {}
  for j, p in ipairs(BUCKETS) do
    if known(p) then since[j] = math.max(get(p .. 'boundary'), answering) end
  end
  local s1, s2, s3, s4 = since[1], since[2], since[3], since[4]
  local any, answered = false, false
  for _, f in pairs(F) do
    any = true
    -- (One the line released and no worker has sent yet will be sent after them.)
    local cleared = f[EXPIRY] - ttl
    if f[STARTED] ~= 1 then cleared = now end
    if (s1 and cleared >= s1) or (s2 and cleared >= s2) or (s3 and cleared >= s3) or (s4 and cleared >= s4) then
      answered = true
      break
    end
  end
  return answered, not any
end

-- Weighs the head of the line, the call of ask `q` (acquire.rs, room_for_head): clear if
-- every bucket holds its reservation above the floor; held while a 429's window is
-- closed, or, with nothing known, while the probe is out (with none out, it goes as
-- the probe); the head may also go as a probe of a window.
local function room_for_head(q)
  if now < get('blocked_until') then
    return {fits = false, wait = get('blocked_until') - now, shorts = {0, 0, 0, 0}, reason = OWED_RATE_LIMITED}
  end
  if not any_known() then
    if get('headerless') == 1 or now >= get('probe_until') then
      if get('headerless') ~= 1 then S['probe_until'] = now + math.min(PROBE_HOLD_MS, ttl) end
      return {fits = true, probe = true, wait = 0, shorts = {0, 0, 0, 0}, reason = OWED_PROBE}
    end
    return {fits = false, wait = get('probe_until') - now, shorts = {0, 0, 0, 0}, reason = OWED_PROBE}
  end
  local room = {fits = true, wait = 0, shorts = {0, 0, 0, 0}, reason = OWED_BUDGET}
  local shorts = room.shorts
  -- The head may go to find a window's next reset when nothing else holds it and no
  -- call cleared since the last reset will bring it (one in flight for longer than a
  -- few late_ms may never: its worker died).
  local answered, no_flights = flights_since_boundary(now - PROBE_AFTER_LATE * late_ms)
  local probe = not answered
  local idle = no_flights and now - get('last_admit') >= BURST_GAP_MS
  local share_known = refund_share(-1) >= 0
  for i, p in ipairs(BUCKETS) do
    if known(p) then
      advance(p)
      local short = need(p, q.costs[i], floor_at(p, q.fl)) - get(p .. 'level')
      if short > 0 then
        room.fits = false
        shorts[i] = short
        room.wait = math.max(room.wait, refill_ms(p, short, false))
        probe = probe and may_probe(p)
      end
    end
  end
  local tokens_only = shorts[1] > 0 and shorts[2] <= 0 and shorts[3] <= 0 and shorts[4] <= 0
  -- A window whose refunds are not known and whose head is held only by them: once
  -- per window, when every call has settled, the head goes alone.
  if not room.fits and idle and not share_known and get('t_refill') == WINDOW and get('t_full_at') > now
    and (get('t_probed') == 0 or get('t_probed') < get('t_boundary')) and tokens_only
    and shorts[1] <= get('t_withheld') then
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

-- When the head of the line is next weighed, ms from now (acquire.rs, head_timer): when
-- the refill brings what it is short of, sooner where that is a guess.
local function head_timer(room, line)
  local t = room.wait
  -- With no host, nothing tells a waiter of the probe's answer: it looks again soon.
  if room.reason == OWED_PROBE and not parks then t = math.min(t, probe_wait) end
  if room.reason == OWED_BUDGET then
    local turns = 0
    if known('t_') then turns = RECHECK_TURNS * line / share_rate('t_') end
    local recheck = math.min(math.max(turns, recheck_min), max_pace)
    local unknown_shape = get('usage_ratio') <= 0
    for _, p in ipairs(BUCKETS) do
      if known(p) and get(p .. 'refill') == UNKNOWN then unknown_shape = true end
    end
    if unknown_shape then t = math.min(t, recheck) end
    -- A bucket learned without headers at its first 429, while the answers of its wave
    -- still lift it (settle.rs, learn_headerless).
    if get('headerless') == 1 and get('hl_prev_span') > 0 then
      for _, f in pairs(F) do
        if f[STARTED] == 1 and f[EXPIRY] - ttl <= get('hl_cut') then
          t = math.min(t, recheck_min)
          break
        end
      end
    end
    -- A window short of no more than its floor, which shrinks to the boundary; with no
    -- host, one short of what the calls in flight are expected to give back, after
    -- about one call's time (acquire.rs, answer_recheck).
    for i, p in ipairs(BUCKETS) do
      if get(p .. 'refill') == WINDOW and room.shorts[i] > 0
        and room.shorts[i] <= floor_at(p, floor_work) * get(p .. 'limit') then
        t = math.min(t, recheck)
      end
      if not parks and get(p .. 'refill') == WINDOW and room.shorts[i] > 0 then
        local holding, field = 0, HELD_FIELDS[i]
        for _, f in pairs(F) do holding = holding + f[field] end
        if holding >= room.shorts[i] then
          local answer = recheck
          -- (At least 50 ms: acquire.rs, ANSWER_RECHECK_MIN_MS.)
          if get('call_ms') > 0 then answer = math.min(math.max(get('call_ms'), 50), recheck) end
          t = math.min(t, answer)
        end
      end
    end
  end
  return math.max(math.min(t, max_pace), 1)
end

-- Why a turn behind the head waits (acquire.rs, reason_behind).
local function reason_behind(tenant)
  if now < get('blocked_until') then return OWED_RATE_LIMITED end
  if not any_known() then return OWED_PROBE end
  local hid, h = head()
  if hid and h[ORDER] >= 0 and h[TENANT] ~= tenant then return OWED_FAIR_SHARE end
  return OWED_BUDGET
end

-- When a turn behind the head is expected clear (acquire.rs, estimate): when the head
-- is, plus as many turns' refill as stand before its place, at its own line cost each.
local function estimate(place)
  local b = 'i_'
  if known('t_') then b = 't_' end
  -- (With a host, the learned rate; with none, the faster reading: acquire.rs, turn_rate.)
  local rate = 0
  if known(b) and parks then rate = get(b .. 'rate') elseif known(b) then rate = share_rate(b) end
  -- (No rate known yet: the probe's answer tells, and lets the line go.)
  if not parks then
    -- With no host the turn comes back then: the line costs ahead of it and its own,
    -- summed, less what the bucket holds above its floor now.
    if rate <= 0 then return now end
    local line = place.line
    if not no_waiters then
      local ids = redis.call('ZRANGEBYSCORE', line_key, '-inf', '(' .. fmt(place.order))
      for _, wid in ipairs(ids) do
        local w = waiter_of(wid)
        if w then line = line + w[LINE] end
      end
    end
    local spare = math.max(level_at(b, now) - floor_work * get(b .. 'limit'), 0)
    return now + math.ceil(math.max(line - spare, 0) / rate)
  end
  local hid, h = head()
  local at = now
  if hid then at = math.max(h[CLEAR], now) end
  if rate <= 0 then return at end
  return at + math.ceil(rank(place.order) * place.line / rate)
end

-- Step 6: the turn waits in line (acquire.rs, park). At the head, its queue entry is due
-- when it is next weighed; behind it, at a safety deadline: the pacer releases it before.
-- -> {1, due_ms, reason, eta_ms}
local function park(q, place, room)
  local due, eta, reason
  if room then
    due = math.ceil(head_timer(room, place.line))
    eta, reason = due, room.reason
  else
    eta = math.max(estimate(place) - now, 1)
    if parks then
      -- (No rate known yet: acquire.rs, SAFETY_UNKNOWN_MS.)
      due = SAFETY_UNKNOWN_MS
      if known('t_') or known('i_') then due = math.min(math.max(2 * eta, SAFETY_MIN_MS), SAFETY_MAX_MS) end
    else
      due = math.min(eta, max_pace)
    end
    reason = reason_behind(q.tenant)
  end
  -- Without a host its waiters come back to ask, jittered so as not to come as a herd;
  -- a parked turn is released by the pacer, one at a time.
  if not parks then
    local base = math.max(math.ceil(due), 1)
    local jitter = math.min(base * jitter_frac, jitter_max) * math.min(math.max(q.u or 0, 0), 1)
    due = math.ceil(base + jitter)
  end
  hist('w', 1)
  local waiter = q.waiter
  if not waiter then
    waiter = {'w', 0, 0, 0, place.order, place.line, 0, 0, now, 0, q.tenant}
    tenant_entry(q.tenant)
    S['twait:' .. q.tenant] = get('twait:' .. q.tenant) + 1
  end
  waiter[TOKENS], waiter[REQUESTS], waiter[OUTPUT] = q.raw_tokens, q.requests, q.output
  waiter[DUE] = now + due
  waiter[CLEAR] = now + eta
  waiter[REASON] = reason
  put_waiter(q.id, waiter)
  return {1, due, reason, eta}
end

-- Step 6 with no host (acquire.rs, pulls_in): a waiter back at its time (not a new ask)
-- may go ahead of a head not due yet when every bucket holds both their reservations
-- above the floor now.
local function pulls_in(q)
  if parks or now < get('blocked_until') or not any_known() or not q.waiter then return false end
  local hid, h = head()
  if not hid or h[DUE] <= now then return false end
  local hq = ask_of(hid, h[TOKENS], h[REQUESTS], h[OUTPUT], h[TENANT], h[ORDER] < 0)
  for i, p in ipairs(BUCKETS) do
    if known(p) then
      advance(p)
      if get(p .. 'level') < need(p, q.costs[i] + hq.costs[i], floor_at(p, q.fl)) then return false end
    end
  end
  return true
end

-- An ask for reservation a[1]: a[2] tokens, [3] requests, [4] jitter_u, [5] 'companion' |
-- 'work', [6] tenant weight, [7] tenant cap (0 none), [8] tenant, [9] output tokens reserved
-- (acquire.rs, acquire).
local function acquire(a)
  expire()
  local q = ask_of(a[1], tonumber(a[2]), tonumber(a[3]), tonumber(a[9]), a[8], a[5] == 'companion')
  q.u = tonumber(a[4]) or 0
  local rec = F[q.id] or waiter_of(q.id)
  -- 1. Asked again for a call already cleared (a redelivery, or a turn the line
  --    released, which its worker starts now): still clear.
  if rec and rec[KIND] == 'f' then
    -- (release.rs, start: one the line released is sent now, unless it was.)
    if rec[STARTED] ~= 1 then send(q.id) end
    return {0}
  end
  if rec and rec[KIND] == 'w' then q.waiter = rec end
  -- 2. Back before its time: owed the rest.
  local early = back_early(q)
  if early then return early end
  ensure_configured()
  -- 3. Nothing known yet: with no probe out this call is the probe; answered without
  --    headers while nothing is configured, nothing is paced at all.
  if not any_known() and (get('headerless') == 1 or now >= get('probe_until')) then
    if get('headerless') ~= 1 then S['probe_until'] = now + math.min(PROBE_HOLD_MS, ttl) end
    return admit(q, nil)
  end
  lift_all()
  -- 4. Its place in line.
  local place, gated = take_place(q, tonumber(a[6]), tonumber(a[7]))
  if not place then return gated end
  -- 5. At the head of the line, clear if its reservation fits above the floor.
  if is_head(q.id, place.order) then
    local room = room_for_head(q)
    if room.fits then
      if room.probe then return admit(q, nil) end
      return admit(q, place)
    end
    return park(q, place, room)
  end
  -- 6. Behind others: parked in line until the pacer releases it — or, with no host,
  --    back at its time ahead of a head not back yet, when the buckets hold both.
  if pulls_in(q) then return admit(q, place) end
  return park(q, place, nil)
end
