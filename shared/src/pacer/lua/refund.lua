-- refund.rs: the share of unused output the provider gives back; `unknown` until learned
-- (0 where it is credited, 1 where it spaces the line).
local function refund_share(unknown)
  -- A budget configured and never described by headers is the workers' own bucket:
  -- charged what a call used (model.rs, learned_share).
  if get('observed_at') == 0 and known('t_') then return 1 end
  local limit = get('t_limit')
  local unused = get('rs_unused')
  local enough = get('rs_pairs') >= 4 or (get('rs_pairs') >= 2 and unused >= 0.25 * limit)
  if not enough or unused < 0.1 * limit or unused <= 0 then return unknown end
  local share = math.min(math.max(get('rs_given') / unused, 0), 1)
  if share < 0.15 then return 0 end
  if share > 0.85 then return 1 end
  return share
end

local function refund_learn(at, remaining, sent, refunded, until_ms)
  local limit, rate = get('t_limit'), refill_rate('t_')
  if at <= get('rs_at') or limit <= 0 then return end
  if get('rs_at') > 0 and (get('rs_until') == 0 or at < get('rs_until')) then
    local span = at - get('rs_at')
    local unused = math.max(refunded - get('rs_refunded'), 0)
    local top = get('rs_remaining') + rate * span + unused
    -- From a full bucket that refills nothing between (a window's), refunds can only
    -- have been clamped where charges had not made room yet.
    local full = get('rs_full') == 1 and rate <= 0
    if span <= max_pace and (full or top < 0.98 * limit) then
      S['rs_given'] = get('rs_given') + remaining - get('rs_remaining') - rate * span + (sent - get('rs_sent'))
      S['rs_unused'] = get('rs_unused') + unused
      -- A pair from a full bucket without refill between spans all its calls' refunds,
      -- exactly: it counts as two.
      if full then S['rs_pairs'] = get('rs_pairs') + 2 else S['rs_pairs'] = get('rs_pairs') + 1 end
      local horizon = 2 * limit
      if get('rs_unused') > horizon then
        local scale = horizon / get('rs_unused')
        S['rs_given'] = get('rs_given') * scale
        S['rs_unused'] = get('rs_unused') * scale
      end
    end
  end
  S['rs_at'], S['rs_remaining'], S['rs_sent'], S['rs_refunded'] = at, remaining, sent, refunded
  -- A bucket (all but) full, as at a window's start (a cold start's probe).
  local full_now = 0
  if remaining >= 0.98 * limit then full_now = 1 end
  S['rs_until'], S['rs_full'] = until_ms, full_now
end

-- A window's boundary starts the refund learner's next pair (refund.rs, window_start).
local function refund_window_start(at, remaining, sent, refunded, until_ms)
  if at <= get('rs_at') then return end
  S['rs_at'], S['rs_remaining'], S['rs_sent'], S['rs_refunded'] = at, remaining, sent, refunded
  S['rs_until'], S['rs_full'] = until_ms, 1
end
