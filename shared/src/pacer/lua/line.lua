-- The records: the calls in flight (field fl of the state, `PacerState::flights`) and the
-- line of waiters (KEYS[2] and its index KEYS[3], `PacerState::waiters`), read as an op needs
-- them and written back with the state by save().
-- A budget's keys live this long after its last acquire or settle: a model not used for a
-- day starts again from a probe, and its keys do not stay in Redis for good.
local IDLE_TTL_MS = 86400000
-- Their expiry is pushed back at most once a minute (field ttl_at), not by every
-- call (four commands a call): a key a call creates in between gets it within
-- the minute, as long as the budget is used.
local TTL_REFRESH_MS = 60000

-- Records: one encode/decode pair. A record is its kind's letter and its numbers as
-- little-endian doubles (`struct.pack`: exact, as '%.17g' text is, and read in a tenth of
-- the time — each batch reads every record), a waiter's tenant after them. Decoded, a
-- record is an array (a table of named fields cost five times as much to build, and a
-- busy budget has hundreds of records), read by the names below: the kind, then the
-- numbers in their stored order. `rec_text` is the form the snapshot hands to Rust
-- (store.rs, decode_record).
local KIND, TOKENS, REQUESTS, OUTPUT = 1, 2, 3, 4
-- A call in flight ('f').
local MARK, EXPIRY, INPUT, SENT, ALONE, IH, OH, OMARK, RSENT, ISENT, OSENT = 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15
-- A waiter ('w').
local ORDER, LINE, DUE, CLEAR, SINCE, REASON, TENANT = 5, 6, 7, 8, 9, 10, 11
-- What a call in flight holds of each bucket, in BUCKETS' order.
local HELD_FIELDS = {TOKENS, REQUESTS, IH, OH}
local W_NUMS, W_LEN = '<ddddddddd', 1 + 9 * 8
local F_NUMS, F_LEN = '<dddddddddddddd', 1 + 14 * 8

local function rec_encode(r)
  if r[KIND] == 'w' then
    return 'W' .. struct.pack(W_NUMS, unpack(r, TOKENS, REASON)) .. r[TENANT]
  end
  return 'F' .. struct.pack(F_NUMS, unpack(r, TOKENS, OSENT))
end

local function rec_text(r)
  if r[KIND] == 'w' then
    return table.concat({'w', fmt(r[ORDER]), fmt(r[TOKENS]), fmt(r[REQUESTS]), fmt(r[OUTPUT]), fmt(r[LINE]),
      fmt(r[DUE]), fmt(r[CLEAR]), fmt(r[SINCE]), fmt(r[REASON]), r[TENANT]}, '|')
  end
  local out = {'f'}
  for k = TOKENS, OSENT do out[k] = fmt(r[k]) end
  return table.concat(out, '|')
end

local function rec_decode(s)
  if not s then return nil end
  local kind = string.sub(s, 1, 1)
  if kind == 'F' and #s == F_LEN then
    local r = {'f', struct.unpack(F_NUMS, s, 2)}
    r[OSENT + 1] = nil
    return r
  elseif kind == 'W' and #s >= W_LEN then
    local r = {'w', struct.unpack(W_NUMS, s, 2)}
    r[TENANT] = string.sub(s, W_LEN + 1)
    return r
  end
  return nil
end

-- The calls in flight (F), read with the state (field fl): every ask and settle
-- looks at all of them, and there are no more than the fleet's slots. Changed here
-- (`put`, `drop`), written back by save() in the state's one HSET.
-- The waiters, which a scarce budget has by the thousand, are read only as an op
-- needs them: its own (`waiter_of`), the ones ahead of it in line (`waiters_ahead`,
-- by the line's index), the least place. A waiter is written at once with its line
-- entry, in the same script, so the next op of a batch reads what the last one left;
-- Wc caches what was read (false: absent, or lapsed).
local F, changed, Wc = {}, {}, {}
-- No waiter at all when the script began, and none put since: every waiter query
-- answers "none" without asking (a budget with room has no line; its asks and settles
-- then read no waiter). Waiters and their line entries are written together. How
-- many there are (lapsed ones not deleted yet among them) is the state's field nw,
-- kept by the writes below (HSET and HDEL say how many they added or removed), so an
-- op reads no index to learn it; counted from the line (ZCARD) where the field is
-- missing (a state written before it was kept) and once a minute with the keys'
-- expiry (TTL_REFRESH_MS), so no drift outlives a minute.
if S['nw'] == nil or now - get('ttl_at') >= TTL_REFRESH_MS or now < get('ttl_at') then
  S['nw'] = redis.call('ZCARD', line_key)
end
local no_waiters = S['nw'] <= 0
-- The calls in flight as read, encoded: written back as they are unless changed.
local F_read = {}
do
  -- Each call: its id's length (2 bytes), its id, its record (rec_encode).
  local v, at = flights_packed or '', 1
  while at + 2 <= #v do
    local n = struct.unpack('<H', v, at)
    local id = string.sub(v, at + 2, at + 1 + n)
    local enc = string.sub(v, at + 2 + n, at + 1 + n + F_LEN)
    at = at + 2 + n + F_LEN
    local r = rec_decode(enc)
    -- A record this version cannot read is dropped (it could only hold budget for nothing).
    if r and r[KIND] == 'f' then
      F[id] = r
      F_read[id] = enc
    else
      changed[id] = true
    end
  end
end

-- Waiters not back by due + grace have lapsed (model.rs, expire): there is no index of
-- lapse times; a lapsed record is taken as absent wherever it is read (every read of a
-- waiter comes here), and deleted, with its line entry, when this script saves.
-- (Whoever asks after it in line reads it: it leaves the line then, as it would have.)
local lapsed_seen = {}
local function live_waiter(id, raw)
  local w = rec_decode(raw)
  if not (w and w[KIND] == 'w') then return false end
  if w[DUE] + grace <= now then
    lapsed_seen[id] = true
    return false
  end
  return w
end

-- Waiter `id`, or nil.
local function waiter_of(id)
  local w = Wc[id]
  if w == nil and no_waiters then return nil end
  if w == nil then
    w = live_waiter(id, redis.call('HGET', waiters, id))
    Wc[id] = w
  end
  return w or nil
end

-- Reads records `ids` this script has not read yet into Wc, in one HMGET.
local function read_waiters(ids, from, to)
  local missing = {}
  for k = from, to do
    if Wc[ids[k]] == nil then missing[#missing + 1] = ids[k] end
  end
  if #missing > 0 then
    local raw = redis.call('HMGET', waiters, unpack(missing))
    for k, wid in ipairs(missing) do Wc[wid] = live_waiter(wid, raw[k]) end
  end
end

-- The head of the line as this script knows it (op `head`, run by the fetch that asks
-- first: its turns are at the head, and the pull-in reads the head after them): the ids
-- in line order and their places, every waiter up to the bound (the last place and id
-- read; none: the whole line), kept so by put and forget_waiter. An ask reads the
-- turns ahead of it from here when they are all within it (no ZRANGEBYSCORE, and its
-- own record read with them), and the pull-in its first waiters.
local head_ids, head_ord, head_bound = nil, nil, nil
local function before(o1, id1, o2, id2) return o1 < o2 or (o1 == o2 and id1 < id2) end
local function read_head(n)
  head_ids, head_ord, head_bound = {}, {}, nil
  if no_waiters then return end
  local raw = redis.call('ZRANGE', line_key, 0, n - 1, 'WITHSCORES')
  for i = 1, #raw, 2 do
    head_ids[#head_ids + 1] = raw[i]
    head_ord[#head_ord + 1] = tonumber(raw[i + 1])
  end
  if #head_ids >= n then head_bound = {head_ord[#head_ord], head_ids[#head_ids]} end
  read_waiters(head_ids, 1, #head_ids)
end
local function head_remove(id)
  if not head_ids then return end
  for i, wid in ipairs(head_ids) do
    if wid == id then
      table.remove(head_ids, i)
      table.remove(head_ord, i)
      return
    end
  end
end
local function head_insert(id, order)
  if not head_ids then return end
  head_remove(id)
  if head_bound and not before(order, id, head_bound[1], head_bound[2]) then return end
  local at = #head_ids + 1
  for i = 1, #head_ids do
    if before(order, id, head_ord[i], head_ids[i]) then
      at = i
      break
    end
  end
  table.insert(head_ids, at, id)
  table.insert(head_ord, at, order)
end

-- Calls visit(wid, w) for each waiter placed at or before `order` (its line's index):
-- the ids from the line, the records read in one HMGET (a slice a time) but for those
-- this script read already.
local function each_waiter_upto(order, visit)
  if no_waiters then return end
  if head_ids and (not head_bound or order < head_bound[1]) then
    -- Every waiter placed at or before `order` is in the head read.
    for i, wid in ipairs(head_ids) do
      if head_ord[i] > order then break end
      local w = Wc[wid]
      if w then visit(wid, w) end
    end
    return
  end
  local ids = redis.call('ZRANGEBYSCORE', line_key, '-inf', order)
  local n = #ids
  for i = 1, n, 1000 do
    local last = math.min(i + 999, n)
    read_waiters(ids, i, last)
    for k = i, last do
      local wid = ids[k]
      local w = Wc[wid]
      if w then visit(wid, w) end
    end
  end
end

local function forget_waiter(id)
  if waiter_of(id) or lapsed_seen[id] then
    S['nw'] = math.max(S['nw'] - redis.call('HDEL', waiters, id), 0)
    redis.call('ZREM', line_key, id)
    lapsed_seen[id] = nil
  end
  head_remove(id)
  Wc[id] = false
end

local function put(id, r)
  if r[KIND] == 'f' then
    forget_waiter(id)
    F[id] = r
    changed[id] = true
  else
    if F[id] then
      F[id] = nil
      changed[id] = true
    end
    no_waiters = false
    local was = Wc[id]
    S['nw'] = S['nw'] + redis.call('HSET', waiters, id, rec_encode(r))
    -- A waiter asking again keeps its place: its line entry is already that. (One
    -- that lapsed is asking afresh: its record and line entry are overwritten.)
    if not (was and was[ORDER] == r[ORDER]) then
      redis.call('ZADD', line_key, r[ORDER], id)
      head_insert(id, r[ORDER])
    end
    lapsed_seen[id] = nil
    Wc[id] = r
  end
end

-- When a call in flight came or went or changed: field fl, every call in flight in
-- one value (read above), goes into `flat` (the state's one HSET) — no HDEL of a
-- call's own field when it settles.
local function save_records(flat)
  if next(changed) == nil then return end
  local parts = {}
  for id, r in pairs(F) do
    local enc = (not changed[id] and F_read[id]) or rec_encode(r)
    F_read[id] = enc
    parts[#parts + 1] = struct.pack('<H', #id) .. id .. enc
  end
  changed = {}
  flat[#flat + 1] = 'fl'
  flat[#flat + 1] = table.concat(parts)
end

local function save()
  -- The lapsed waiters this script read and nobody put again leave the line.
  local gone = {}
  for id in pairs(lapsed_seen) do gone[#gone + 1] = id end
  lapsed_seen = {}
  for i = 1, #gone, 500 do
    local chunk = {unpack(gone, i, math.min(i + 499, #gone))}
    S['nw'] = math.max(S['nw'] - redis.call('HDEL', waiters, unpack(chunk)), 0)
    redis.call('ZREM', line_key, unpack(chunk))
  end
  fold_hist()
  local refresh = now - get('ttl_at') >= TTL_REFRESH_MS or now < get('ttl_at')
  if refresh then S['ttl_at'] = now end
  local flat = {}
  local vals, any = {}, false
  for i, k in ipairs(FIXED) do
    local v = S[k]
    if v then any = true else v = 0 end
    vals[i] = v
  end
  if any then
    local n = struct.pack(PACKED, unpack(vals))
    if n ~= packed then
      flat[1], flat[2] = 'n', n
      packed = n
    end
  end
  for k, v in pairs(S) do
    -- (NaN never equals itself: it is written, as it was before.)
    if not IS_FIXED[k] and v ~= read[k] then
      flat[#flat + 1] = k
      flat[#flat + 1] = fmt(v)
    end
  end
  if last_admit_changed then
    flat[#flat + 1] = 'last_admit_id'
    flat[#flat + 1] = last_admit_id
  end
  save_records(flat)
  for i = 1, #flat, 1000 do redis.call('HSET', state, unpack(flat, i, math.min(i + 999, #flat))) end
  for k, v in pairs(S) do read[k] = v end
  last_admit_changed = false
  if refresh then
    for _, k in ipairs({state, waiters, line_key}) do redis.call('PEXPIRE', k, IDLE_TTL_MS) end
  end
end

local function put_waiter(id, w) put(id, w) end

-- Forgets reservation `id`, a call in flight or a waiter.
local function drop(id)
  if F[id] then
    -- (A call in flight is no waiter: put took it out of line when it was cleared.)
    F[id] = nil
    changed[id] = true
    Wc[id] = false
    return
  end
  forget_waiter(id)
end
