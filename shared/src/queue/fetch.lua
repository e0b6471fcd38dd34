-- The queue's fetch, a function (prepended after lib.lua): the queue's own fetch script
-- calls it, and so does a script that does more with each turn it leases (the run
-- store's fetch starts them: runs/store.rs `fetch_script`).
--
-- q_fetch(max, lease_ms, dead_keep_ms, me, why, on_leased, hold): fetch and lease up to
-- `max` due turns for `lease_ms` ms for worker `me` (`dead_keep_ms`: the dead set's
-- retention). `why` the worker fetches (mod.rs `FetchWhy`): '1' a wake-up token, 'w' its
-- watch's timer, 'k' a kick, 's' the safety net, 'a' a slot freed after a full batch,
-- '0' unsaid. A fetch that finds nothing counts itself under its cause (Q_EMPTY_FIELD:
-- the queue's counters, KEYS[Q_NKEYS+2]), one HINCRBY as before. `woken` ('1'): this
-- fetch follows a wake-up token its worker took, so others may
-- be left over (pushed while no worker listened): a fetch that takes everything due
-- clears them. Any other fetch leaves them (a token reaches a listening worker at once,
-- so leftovers are rare; clearing them at every fetch cost a DEL a turn).
-- KEYS[Q_NKEYS+1]: the epoch a record never leased was last given (q_next_epochs);
-- KEYS[Q_NKEYS+2]: the queue's counters
-- (empty_fetches[:cause]: a fetch that found nothing due is a cost to count, not to accept).
-- `on_leased(id, r)` (optional), called for each leased turn with its record once its
-- lease is written, returns what the delivery carries besides (an array; nil: nothing).
-- `hold(ids, recs, now)` (optional), called with the due turns before any is leased
-- (`recs[i]` decoded, nil when unreadable; it may change a record's payload), returns
-- the ones to leave queued, id -> their new due time (the run store's fetch asks the
-- pacer for a turn back from a budget wait, and one still owed waits again here), and the
-- due times of queued turns it moved up (an array; the watch must not sleep past them).
-- Returns {now, then, held, id, epoch, deliveries, due, payload, {extra}, ...} (held:
-- how many due turns `hold` left queued); `then` says
-- what the worker does once it has started these (mod.rs `Then`):
--   '-2'  the batch was full and more may be due: fetch again when a slot frees;
--   '-1'  nothing more is due: wait for a wake-up token (or the safety net);
--   'ms'  nothing more is due, and this worker sleeps towards the next due
--         turn, in `ms`: the one idle worker that does (KEYS[7], lib.lua).
-- A worker asks for no more than its free slots, so a batch that is not full
-- leaves it idle with a slot to spare: it is the one to watch.
-- A lease's epoch is never handed out twice under an id. Q_EPOCHS_PER_MS epochs belong
-- to each ms of the server's clock: a record's later lease takes max(last + 1, now's
-- first); a record never leased (new, or made again under an id whose record was
-- deleted) takes the upper half of now's epochs, and at least Q_FRESH_STEP past the last
-- such epoch (KEYS[Q_NKEYS+1]) — so past every epoch an earlier record under its id had,
-- in an earlier ms (the clock) or this one (the half, and the last one given: a record
-- is leased far fewer than Q_FRESH_STEP times in one ms). The last one given runs ahead
-- of the clock only past Q_EPOCHS_PER_MS / 2 / Q_FRESH_STEP such fetches in one ms (a
-- Redis runs a few scripts a ms), so what a restart's clock puts past is not outrun.
-- After a Redis whose AOF lost its last second restarts, the leases lost with it had
-- epochs of ms before the restart, and the clock puts every new one past them (the
-- counter this replaces was rolled back with the AOF, and handed them out again). Holds
-- while the server's clock does not go back across them, and while a record is leased
-- fewer than Q_FRESH_STEP times in one ms. Exact in Lua's doubles (2^53) for ms up
-- to the year 2248.
local Q_EPOCHS_PER_MS, Q_FRESH_STEP = 1024, 16
local function q_next_epochs(lasts, now)
  local out, fresh = {}, nil
  for i, last in ipairs(lasts) do
    if last == 0 then
      if not fresh then
        -- Set and read in one command; set again only when the last was of this very ms.
        fresh = now * Q_EPOCHS_PER_MS + Q_EPOCHS_PER_MS / 2
        local given = tonumber(redis.call('SET', KEYS[Q_NKEYS + 1], string.format('%d', fresh), 'GET') or '') or 0
        if given + Q_FRESH_STEP > fresh then
          fresh = given + Q_FRESH_STEP
          redis.call('SET', KEYS[Q_NKEYS + 1], string.format('%d', fresh))
        end
      end
      out[i] = fresh
    else
      out[i] = math.max(last + 1, now * Q_EPOCHS_PER_MS)
    end
  end
  return out
end

local Q_EMPTY_FIELD = {['1'] = 'empty_fetches:token', w = 'empty_fetches:watch', k = 'empty_fetches:kick',
  s = 'empty_fetches:safety', a = 'empty_fetches:again'}

local function q_fetch(max, lease_ms, dead_keep_ms, me, why, on_leased, hold)
  local woken = why == '1'
  local now = q_now()
  -- The first max + 1 queued turns by due time: those due now (at most max), and
  -- after them the next one, whose due time says whether more are due and when.
  local head = redis.call('ZRANGE', Q_DUE, 0, max, 'WITHSCORES')
  local due, nxt = {}, nil
  for i = 1, #head, 2 do
    if #due < 2 * max and tonumber(head[i + 1]) <= now then
      due[#due + 1] = head[i]; due[#due + 1] = head[i + 1]
    else
      nxt = tonumber(head[i + 1])
      break
    end
  end
  local n = #due / 2
  local out = {tostring(now), '-1', '0'}
  if n == 0 then
    redis.call('HINCRBY', KEYS[Q_NKEYS + 2], Q_EMPTY_FIELD[why] or 'empty_fetches', 1)
  else
    local ids = {}
    for i = 1, n do ids[i] = due[2 * i - 1] end
    local recs = redis.call('HMGET', Q_JOBS, unpack(ids))
    local hset, zadd, leased, held = {}, {}, {}, {}
    local decoded = {}
    for i = 1, n do decoded[i] = q_decode(recs[i]) end
    local keep, moved = {}, {}
    if hold then keep, moved = hold(ids, decoded, now) end
    -- Turns queued later that `hold` moved up: the watch below sees them.
    for _, at in ipairs(moved or {}) do
      if not nxt or at < nxt then nxt = at end
    end
    -- Out of the due set, but for the turns left queued (their ZADD below moves
    -- them to their new due time: a fetch that holds every turn removes none).
    local gone = {}
    for i = 1, n do
      if not (keep[ids[i]] and decoded[i] and decoded[i].flag == 'q') then gone[#gone + 1] = ids[i] end
    end
    if #gone > 0 then redis.call('ZREM', Q_DUE, unpack(gone)) end
    local lasts, slot = {}, {}
    for i = 1, n do
      if decoded[i] and decoded[i].flag == 'q' and not keep[ids[i]] then
        lasts[#lasts + 1] = decoded[i].epoch
        slot[i] = #lasts
      end
    end
    local epochs = q_next_epochs(lasts, now)
    for i = 1, n do
      local r = decoded[i]
      local again = keep[ids[i]]
      if again and r and r.flag == 'q' then
        -- Left queued (not a delivery): due again then; the watch below sees it.
        held[#held + 1] = again; held[#held + 1] = ids[i]
        if not nxt or again < nxt then nxt = again end
      elseif r and r.flag == 'q' then
        r.epoch = epochs[slot[i]]
        r.deliveries = r.deliveries + 1
        r.flag = 'l'
        hset[#hset + 1] = ids[i]; hset[#hset + 1] = q_encode(r)
        zadd[#zadd + 1] = now + lease_ms; zadd[#zadd + 1] = ids[i]
        out[#out + 1] = ids[i]; out[#out + 1] = string.format('%d', r.epoch); out[#out + 1] = tostring(r.deliveries)
        out[#out + 1] = due[2 * i]; out[#out + 1] = r.payload
        leased[#leased + 1] = {ids[i], r, #out + 1}
        out[#out + 1] = {}
      elseif recs[i] and not r then
        -- A record this version cannot read: buried with its raw text, and its run
        -- failed, never dropped (a dropped turn left its run waiting forever).
        local dead = {epoch = 0, deliveries = 0, flag = 'd', payload = recs[i]}
        q_bury(ids[i], dead, 'unreadable queue record (written by another version?)', now, dead_keep_ms)
      elseif not recs[i] then
        -- Due, with no record at all: no script leaves a turn so, but a Redis that
        -- evicts keys does (paceline refuses to start on one; a policy changed later
        -- still can). Buried and its run failed with the reason, never dropped unseen.
        local dead = {epoch = 0, deliveries = 0, flag = 'd', payload = ''}
        q_bury(ids[i], dead, 'its queue record is missing (evicted? Redis must run with maxmemory-policy noeviction)',
          now, dead_keep_ms)
      end
    end
    if #hset > 0 then redis.call('HSET', Q_JOBS, unpack(hset)) end
    if #zadd > 0 then redis.call('ZADD', Q_LEASE, unpack(zadd)) end
    if #held > 0 then
      redis.call('ZADD', Q_DUE, unpack(held))
      out[3] = tostring(#held / 2)
    end
    if on_leased then
      for _, l in ipairs(leased) do out[l[3]] = on_leased(l[1], l[2]) or {} end
    end
    if n == max then
      -- This worker has no slot left (or, if it held some back, fetches again at
      -- once), so it cannot watch. When more is due, pass
      -- the baton, so 10 000 turns due at once are taken by every idle worker,
      -- not just this one; when the watch it held fell due (it took that turn),
      -- wake one idle worker to watch the next.
      out[2] = '-2'
      if nxt and (nxt <= now or not q_watched(now)) then q_wake() end
      return out
    end
  end
  -- Took everything due: leftover tokens would only wake workers for nothing.
  if woken then redis.call('DEL', Q_NOTIFY) end
  if not nxt then return out end
  local at = nxt
  -- Claimed at once, reading the claim it replaces (one command, not a GET and
  -- a SET: most fetches that get here claim) …
  local old = redis.call('SET', Q_TIMER, string.format('%d|%s', at, me), 'PX', math.max(at - now, 1) + lease_ms, 'GET')
  local watched, who = q_claim_of(old, now)
  if watched and watched == at and who ~= me and who ~= '*' then
    -- … and given back when another idle worker sleeps towards this very time
    -- (it takes what is due when it wakes, then watches the next), expiring when
    -- it would have. A claim for an earlier time is stale: nothing is due before
    -- `at` (a release moved the turn it watched to now, and it was taken), so this
    -- worker watches instead, and the one that claimed it finds its claim gone when
    -- its timer goes, and listens rather than fetch for nothing (backend/fetcher.rs
    -- `after_watch`). A claim for whoever takes a token (`*`, lib.lua q_wake_at) is
    -- taken over: its token may be gone (a token-woken fetch clears those left over,
    -- and a commit's claim for its own process has none), so this worker watches (a
    -- worker that took the token watches too: one of the two fetches for nothing).
    redis.call('SET', Q_TIMER, old, 'PX', math.max(watched - now, 1) + lease_ms)
    return out
  end
  out[2] = tostring(math.max(at - now, 0))
  return out
end
