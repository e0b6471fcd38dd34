-- bucket.rs
local function known(p) return get(p .. 'limit') > 0 and get(p .. 'rate') > 0 end

-- The continuous refill counted on: none for a window, nor while the shape is unknown.
local function refill_rate(p)
  if get(p .. 'refill') == WINDOW then return 0 end
  return get(p .. 'rate')
end

local function window_ms(p) return math.max(get(p .. 'max_reset'), 1) end

-- The average refill for what spaces turns (caps, the recheck horizon).
local function share_rate(p)
  if get(p .. 'refill') == UNKNOWN then return math.max(get(p .. 'rate'), get(p .. 'limit') / window_ms(p)) end
  return get(p .. 'rate')
end

-- Never above the bucket's top (bucket.rs, top): its limit, less what the line released
-- that no worker has sent yet.
local function level_at(p, at)
  local elapsed = math.max(at - get(p .. 'at'), 0)
  return math.min(get(p .. 'level') + refill_rate(p) * elapsed, get(p .. 'limit') - UNSENT[p])
end

-- A bucket without continuous refill whose next reset no headers named: the window after the last lift.
local function guessed_boundary(p)
  if get(p .. 'refill') == CONTINUOUS or get(p .. 'full_at') > now or get(p .. 'boundary') <= 0 then return nil end
  local window = math.max(window_ms(p), MIN_WINDOW_MS)
  local passed = math.floor((now - get(p .. 'boundary')) / window) + 1
  return get(p .. 'boundary') + math.ceil(passed * window)
end

-- The head may go to find the next reset, once per window.
local function may_probe(p)
  local window = math.floor(math.max(window_ms(p), MIN_WINDOW_MS))
  return get(p .. 'refill') == WINDOW and get(p .. 'full_at') <= now and now - get(p .. 'boundary') >= window
    and now - get(p .. 'probed') >= window
end

-- A provider that gave back what we withheld would fill to its limit, no further.
local function cap_withheld(p)
  S[p .. 'withheld'] = math.min(get(p .. 'withheld'), math.max(get(p .. 'limit') - get(p .. 'level'), 0))
end

local function advance(p)
  if now > get(p .. 'at') then
    local level = level_at(p, now)
    if get(p .. 'refill') == UNKNOWN then
      S[p .. 'unknown_credit'] = get(p .. 'unknown_credit') + math.max(level - get(p .. 'level'), 0)
    end
    S[p .. 'level'] = level
    S[p .. 'at'] = now
  end
  cap_withheld(p)
end

-- Credits (or, negative, takes back) tokens given back to the bucket.
local function credit(p, x)
  S[p .. 'level'] = math.min(get(p .. 'level') + x, math.max(get(p .. 'limit') - UNSENT[p], get(p .. 'level')))
  S[p .. 'charged_since'] = math.max(get(p .. 'charged_since') - x, 0)
end

-- Credits a refund given when an answer was done (perhaps before its settle): a provider
-- then full kept only what fitted: the level is lifted no higher than cap.
local function credit_refund(p, x, cap)
  local room = math.max(cap - get(p .. 'level'), 0)
  local credited = math.max(math.min(x, room), 0)
  S[p .. 'level'] = get(p .. 'level') + credited
  S[p .. 'charged_since'] = math.max(get(p .. 'charged_since') - credited, 0)
end

local function window_refill_ms(p, short)
  local window = window_ms(p)
  local full_at = get(p .. 'full_at')
  if full_at > now then
    local beyond = short + get(p .. 'level') - get(p .. 'limit')
    local more = 0
    if beyond > 0 then more = math.ceil(beyond / get(p .. 'limit')) end
    return (full_at - now) + more * window
  end
  local guess = guessed_boundary(p)
  if guess then return guess - now end
  return short * window / get(p .. 'limit')
end

local function refill_ms(p, short, deep)
  if short <= 0 then return 0 end
  local shape = get(p .. 'refill')
  if shape == UNKNOWN then
    -- The window's boundary, or the refill the level counts meanwhile (bucket.rs).
    if get(p .. 'rate') > 0 then return math.min(window_refill_ms(p, short), short / get(p .. 'rate')) end
    return window_refill_ms(p, short)
  elseif shape == WINDOW then
    return window_refill_ms(p, short)
  end
  local full_at = get(p .. 'full_at')
  if full_at > now then
    -- Full at the reset the headers named; a deep wait's rest, past what is missing,
    -- at the rate after it (bucket.rs).
    local beyond = 0
    if deep then beyond = math.max(short - math.max(get(p .. 'limit') - get(p .. 'level'), 0), 0) end
    return math.min(short / get(p .. 'rate'), (full_at - now) + beyond / get(p .. 'rate'))
  end
  return short / get(p .. 'rate')
end

-- At the reset the bucket is full again but for what was sent since: a window
-- less only `recent` (cleared just before its boundary), else less charged_since.
local function lift(p, recent)
  local full_at = get(p .. 'full_at')
  if full_at > 0 and now >= full_at then
    advance(p)
    local charged = get(p .. 'charged_since')
    if get(p .. 'refill') == WINDOW then charged = recent end
    S[p .. 'level'] = math.max(get(p .. 'level'), get(p .. 'limit') - charged)
    if get(p .. 'refill') == WINDOW then S[p .. 'charged_since'] = 0 end
    S[p .. 'boundary'] = full_at
    S[p .. 'full_at'] = 0
  end
end

-- A snapshot's shape evidence against the last one: ratios of reset to missing
-- that agree vote continuous, resets that moved against what is missing vote window.
local function vote(p, at, missing, reset_ms, limit)
  S[p .. 'max_reset'] = math.max(get(p .. 'max_reset'), reset_ms)
  local missing1, reset1 = get(p .. 'obs_missing'), get(p .. 'obs_reset')
  local function readable(m, r) return m >= VOTE_MISSING * limit and r >= MIN_VOTE_RESET_MS end
  if get(p .. 'obs_at') > 0 and readable(missing, reset_ms) and readable(missing1, reset1)
    and math.abs(missing - missing1) >= VOTE_MISSING * limit then
    local a, b = reset_ms * missing1, reset1 * missing
    -- Only a pair across which more went missing and the reset grew votes continuous
    -- (bucket.rs, vote).
    local grew, later = missing - missing1, reset_ms - reset1
    if at < get(p .. 'obs_at') then grew, later = missing1 - missing, reset1 - reset_ms end
    if grew > 0 and later > 0 and math.abs(a - b) <= VOTE_AGREE * math.max(a, b) then
      S[p .. 'votes'] = math.max(get(p .. 'votes') - 1, -MAX_VOTES)
    elseif (missing - missing1) * (reset_ms - reset1) < 0 then
      S[p .. 'votes'] = math.min(get(p .. 'votes') + 1, MAX_VOTES)
    end
    if get(p .. 'votes') >= SHAPE_VOTES then
      S[p .. 'refill'] = WINDOW
    elseif get(p .. 'votes') <= -SHAPE_VOTES then
      S[p .. 'refill'] = CONTINUOUS
    end
  end
  S[p .. 'obs_at'], S[p .. 'obs_missing'], S[p .. 'obs_reset'] = math.max(at, 1), missing, reset_ms
end

-- The floor kept on a bucket now: in a window, its share of the window still to come
-- (bucket.rs, floor_at).
local function floor_at(p, fl)
  local full_at = get(p .. 'full_at')
  if get(p .. 'refill') == WINDOW and full_at > now then
    return fl * math.min(math.max((full_at - now) / window_ms(p), 0), 1)
  end
  return fl
end

local function need(p, cost, fl)
  local limit = get(p .. 'limit')
  return math.min(cost + fl * limit, limit)
end

local function any_known()
  for _, p in ipairs(BUCKETS) do
    if known(p) then return true end
  end
  return false
end

-- A continuous bucket of `limit` and `rate`, at `level`, with nothing else known of it
-- (model.rs: a fresh `Bucket` with these set; `Bucket::per_minute` for a configured one).
local function fresh_bucket(p, limit, rate, level)
  S[p .. 'refunded'], S[p .. 'full_at'], S[p .. 'charged_since'], S[p .. 'rated'], S[p .. 'full_seen'] = 0, 0, 0, 0, 0
  S[p .. 'inflight'], S[p .. 'sent'], S[p .. 'withheld'] = 0, 0, 0
  S[p .. 'votes'], S[p .. 'max_reset'], S[p .. 'obs_at'], S[p .. 'obs_missing'], S[p .. 'obs_reset'] = 0, 0, 0, 0, 0
  S[p .. 'boundary'], S[p .. 'probed'], S[p .. 'unknown_credit'], S[p .. 'assumed'] = 0, 0, 0, 0
  S[p .. 'limit'], S[p .. 'rate'], S[p .. 'level'], S[p .. 'at'], S[p .. 'refill'] = limit, rate, level, now, 1
end

local function ensure_configured()
  if not known('t_') and tpm > 0 then fresh_bucket('t_', tpm, tpm / 60000, tpm) end
  if not known('r_') and rpm > 0 then fresh_bucket('r_', rpm, rpm / 60000, rpm) end
end

-- since: what changed at the provider after the headers that they cannot show
-- (refunds given back since, less what was cleared after the observed call).
-- own: what the observed call itself was charged here; settled_after: what calls cleared
-- after it were charged and have settled already (not in these headers, nor in flight).
local function observe(p, limit, remaining, reset_ms, headers_at, since, own, settled_after, unseen_refunds)
  if remaining < 0 or limit == 0 then return end
  if limit > 0 then
    S[p .. 'assumed'] = 0
  elseif known(p) and get(p .. 'assumed') == 0 then
    -- remaining alone (Azure OpenAI): the limit configured or read before
    limit = get(p .. 'limit')
  else
    -- ... or at least what remained plus the observed call's own charge
    S[p .. 'assumed'] = 1
    limit = math.max(get(p .. 'limit'), remaining + own)
  end
  if limit <= 0 then return end
  local has_reset = reset_ms >= 0
  if reset_ms < 0 then reset_ms = 0 end
  if reset_ms > max_pace then return end
  remaining = math.min(remaining, limit)
  local missing = limit - remaining
  local was_unknown = get(p .. 'refill') == UNKNOWN
  if has_reset then vote(p, headers_at, missing, reset_ms, limit) end
  -- Nothing says when it refills: a per-minute limit refilling continuously.
  if not has_reset then S[p .. 'refill'] = CONTINUOUS end
  if get(p .. 'refill') == WINDOW then
    S[p .. 'rate'] = limit / window_ms(p)
    S[p .. 'rated'] = 1
  elseif reset_ms >= 20 and missing >= limit * 0.1 then
    S[p .. 'rate'] = missing / reset_ms
    S[p .. 'rated'] = 1
  elseif reset_ms >= 20 and missing >= limit * 0.005 and (get(p .. 'rated') == 0 or missing / reset_ms > get(p .. 'rate')) then
    -- A lightly used bucket's reading may only raise the rate.
    S[p .. 'rate'] = missing / reset_ms
    S[p .. 'rated'] = 1
  elseif get(p .. 'rate') <= 0 or get(p .. 'limit') ~= limit then
    S[p .. 'rate'] = limit / 60000
  end
  if not known(p) or get(p .. 'limit') ~= limit then
    if get(p .. 'limit') <= 0 then
      S[p .. 'level'] = limit
      S[p .. 'at'] = now
    end
    S[p .. 'limit'] = limit
  end
  advance(p)
  if was_unknown and get(p .. 'refill') ~= UNKNOWN then
    -- A window gave nothing back before its boundary: take back the refill counted while unknown.
    if get(p .. 'refill') == WINDOW then S[p .. 'level'] = get(p .. 'level') - get(p .. 'unknown_credit') end
    S[p .. 'unknown_credit'] = 0
  end
  -- A window's headers from before a boundary that has passed since describe the window that ended.
  if get(p .. 'refill') == WINDOW and has_reset and headers_at + reset_ms <= now then return end
  local elapsed = math.max(now - headers_at, 0)
  local theirs = math.min(remaining + since + refill_rate(p) * elapsed, limit)
  if theirs < get(p .. 'level') then
    local lowered = get(p .. 'level') - theirs
    S[p .. 'level'] = theirs
    -- Of the refunds withheld, only those given after these headers are still owed; what
    -- these headers lowered the level by may be charges they already counted (a burst):
    -- outside a window it is withheld too, for later headers to give back (bucket.rs).
    if get(p .. 'refill') == WINDOW then lowered = 0 end
    S[p .. 'withheld'] = math.min(get(p .. 'withheld'), unseen_refunds) + lowered
    if get(p .. 'refill') == UNKNOWN then S[p .. 'unknown_credit'] = get(p .. 'rate') * elapsed end
  end
  if has_reset and headers_at >= get(p .. 'full_seen') then
    S[p .. 'full_seen'] = headers_at
    S[p .. 'full_at'] = headers_at + reset_ms
    S[p .. 'charged_since'] = get(p .. 'inflight') + settled_after
  end
end
