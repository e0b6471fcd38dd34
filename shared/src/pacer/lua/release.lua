-- release.rs: the line lets its turns go, once each. With every op (before an ask, after a
-- settle or a forget) the head of the line is weighed: while it fits it is admitted and handed to the host (PACER_HOST: the run
-- store's queue, runs/pacer_host.lua — its entry is due now, cleared); the first that does
-- not fit gets the line's one timer, its queue entry due when it is next weighed. A host
-- that no longer holds a turn (its run ended while it waited) has it dropped from the line.
-- Without a host (the pacer's own tests) every turn is held. What was moved is kept in
-- `moves` ({id, at, 1 released | 0 retimed}, op `moves`).
local moves = {}

local function host_release(id)
  if PACER_HOST then return PACER_HOST.release(id, now) end
  return true
end

local function host_retime(id, at)
  if PACER_HOST then return PACER_HOST.retime(id, at, now) end
  return true
end

local function host_holds(id)
  if PACER_HOST then return PACER_HOST.holds(id) end
  return true
end

-- Moves the head `hid`'s timer to `at` (release.rs, retime); false (and the turn dropped
-- from the line) when its host no longer holds it.
local function retime(hid, w, at)
  if not host_retime(hid, at) then
    forget_waiter(hid)
    return false
  end
  w[DUE], w[CLEAR] = at, at
  put_waiter(hid, w)
  moves[#moves + 1] = {hid, at, 0}
  return true
end

-- When the head's timer goes, to fit at `at` (release.rs, timer_at): a call on its way
-- (started, not twice call_ms old) expected to settle sooner weighs the head again, so
-- the timer goes only to when the last of those is overdue.
local function timer_at(at)
  local c = get('call_ms')
  if c <= 0 then return at end
  local n, last = 0, 0
  for _, f in pairs(F) do
    local overdue = f[EXPIRY] - ttl + 2 * c
    if f[STARTED] == 1 and overdue >= now then
      n = n + 1
      last = math.max(last, overdue)
    end
  end
  if n > 0 and now + c / n <= at then return math.max(at, math.ceil(last)) end
  return at
end

-- Weighs the head `hid` (release.rs, the loop's body): whether the line goes on to the
-- next head (this one left it), and whether it was let go.
local function weigh_head(hid, w)
  local q = ask_of(hid, w[TOKENS], w[REQUESTS], w[OUTPUT], w[TENANT], w[ORDER] < 0)
  local room = room_for_head(q)
  if room.fits and room.probe and get('headerless') == 1 then
    -- Nothing is paced (release.rs): the line wakes, each turn due now, to ask.
    forget_waiter(hid)
    if host_retime(hid, now) then moves[#moves + 1] = {hid, now, 0} end
    return true, true
  elseif room.fits then
    if not host_release(hid) then
      forget_waiter(hid)
      return true, false
    end
    local place = nil
    if not room.probe then place = {order = w[ORDER], line = w[LINE]} end
    reserve(q, place)
    moves[#moves + 1] = {hid, now, 1}
    return true, true
  end
  local at = timer_at(now + math.ceil(head_timer(room, w[LINE])))
  local changed = w[REASON] ~= room.reason
  w[REASON] = room.reason
  if at + RETIME_GAIN_MS < w[DUE] then
    return not retime(hid, w, at), false
  elseif now > w[DUE] + late_ms then
    -- A head well past its timer that has not asked (release.rs): its entry waits for a
    -- slot, or was lost with its run. Asked once a late_ms.
    if host_holds(hid) then
      w[DUE] = now
      put_waiter(hid, w)
      return false, false
    end
    forget_waiter(hid)
    return true, false
  end
  if changed then put_waiter(hid, w) end
  return false, false
end

local function release()
  local released = 0
  while not no_waiters do
    local hid, w = head()
    if not hid then break end
    if not parks then
      -- No host to move a turn (release.rs): the line moves only as its turns ask; a
      -- head not back within the grace has stopped asking.
      if now <= w[DUE] + (tonumber(ARGV[12]) or 0) then break end
      forget_waiter(hid)
    elseif released >= MAX_RELEASES then
      -- More may fit: the head asks at once, and its ask releases the rest.
      if now + RETIME_GAIN_MS < w[DUE] then retime(hid, w, now) end
      break
    else
      local go_on, let_go = weigh_head(hid, w)
      if let_go then released = released + 1 end
      if not go_on then break end
    end
  end
end

-- Turn `id` leaves the pacer without being sent (release.rs, forget): its run ended while
-- it waited. Out of the line, or, released and not started yet, its reservation given back.
local function forget(id)
  local f = F[id]
  if not f then
    forget_waiter(id)
  elseif f[STARTED] ~= 1 then
    drop_flight(id, f)
  end
end
