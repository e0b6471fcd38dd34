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
local MARK, EXPIRY, INPUT, SENT, ALONE, IH, OH, OMARK, RSENT, ISENT, OSENT, STARTED =
  5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16
-- A waiter ('w').
local ORDER, LINE, DUE, CLEAR, SINCE, REASON, TENANT = 5, 6, 7, 8, 9, 10, 11
-- What a call in flight holds of each bucket, in BUCKETS' order.
local HELD_FIELDS = {TOKENS, REQUESTS, IH, OH}
local W_NUMS, W_LEN = '<ddddddddd', 1 + 9 * 8
local F_NUMS, F_LEN = '<ddddddddddddddd', 1 + 15 * 8

local function rec_encode(r)
  if r[KIND] == 'w' then
    return 'W' .. struct.pack(W_NUMS, unpack(r, TOKENS, REASON)) .. r[TENANT]
  end
  return 'F' .. struct.pack(F_NUMS, unpack(r, TOKENS, STARTED))
end

local function rec_text(r)
  if r[KIND] == 'w' then
    return table.concat({'w', fmt(r[ORDER]), fmt(r[TOKENS]), fmt(r[REQUESTS]), fmt(r[OUTPUT]), fmt(r[LINE]),
      fmt(r[DUE]), fmt(r[CLEAR]), fmt(r[SINCE]), fmt(r[REASON]), r[TENANT]}, '|')
  end
  local out = {'f'}
  for k = TOKENS, STARTED do out[k] = fmt(r[k]) end
  return table.concat(out, '|')
end

local function rec_decode(s)
  if not s then return nil end
  local kind = string.sub(s, 1, 1)
  if kind == 'F' and #s == F_LEN then
    local r = {'f', struct.unpack(F_NUMS, s, 2)}
    r[STARTED + 1] = nil
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
-- The waiters, which a scarce budget has by the thousand (or the hundred thousand), are
-- read only as an op needs them: its own (`waiter_of`), and the head of the line
-- (`head`), which is kept in the state: no op reads the turns ahead of it. A waiter is
-- written at once with its line entry, in the same script, so the next op of a batch
-- reads what the last one left; Wc caches what was read (false: absent).
local F, changed, Wc = {}, {}, {}
-- No waiter at all when the script began, and none put since: every waiter query
-- answers "none" without asking (a budget with room has no line; its asks and settles
-- then read no waiter). Waiters and their line entries are written together. How
-- many there are is the state's field nw,
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

-- What the line released that no worker has sent yet, on each bucket (bucket.rs,
-- Bucket::unsent): counted from the calls in flight, after each change to them.
local UNSENT = {t_ = 0, r_ = 0, i_ = 0, o_ = 0}
local function count_unsent()
  local u1, u2, u3, u4 = 0, 0, 0, 0
  for _, f in pairs(F) do
    if f[STARTED] ~= 1 then
      u1, u2, u3, u4 = u1 + f[TOKENS], u2 + f[REQUESTS], u3 + f[IH], u4 + f[OH]
    end
  end
  UNSENT.t_, UNSENT.r_, UNSENT.i_, UNSENT.o_ = u1, u2, u3, u4
end
count_unsent()

-- Waiter `id`, or nil (Wc caches what was read; false: absent).
local function waiter_of(id)
  local w = Wc[id]
  if w == nil and no_waiters then return nil end
  if w == nil then
    w = rec_decode(redis.call('HGET', waiters, id))
    if not (w and w[KIND] == 'w') then w = false end
    Wc[id] = w
  end
  return w or nil
end

-- The head of the line (state.rs, head): the waiter first by place, then id, as the
-- line's index orders them. Kept in the state (field hd: its id's length, its id, its
-- record), so an op that only weighs it reads nothing more; read from the index when
-- the head left (forgotten, released) or the field is missing. `head_id` false: not
-- known yet; nil: no head.
local head_id, head_rec, head_changed = false, nil, false
if head_packed and #head_packed > 2 then
  local n = struct.unpack('<H', head_packed, 1)
  local w = rec_decode(string.sub(head_packed, 3 + n))
  if w and w[KIND] == 'w' then
    head_id, head_rec = string.sub(head_packed, 3, 2 + n), w
    Wc[head_id] = w
  end
end
local function head()
  if head_id == false then
    head_id, head_rec, head_changed = nil, nil, true
    if not no_waiters then
      local first = redis.call('ZRANGE', line_key, 0, 0)[1]
      if first then
        head_id, head_rec = first, waiter_of(first)
        if not head_rec then head_id = nil end
      end
    end
  end
  return head_id, head_rec
end

-- Whether `id` at `order` is (or would be) the head of the line (state.rs, is_head).
local function is_head(id, order)
  local hid, h = head()
  if not hid or hid == id then return true end
  return order < h[ORDER] or (order == h[ORDER] and id < hid)
end

-- How many waiters stand strictly before place `order` (acquire.rs, estimate).
local function rank(order)
  if no_waiters then return 0 end
  return redis.call('ZCOUNT', line_key, '-inf', '(' .. fmt(order))
end

local function forget_waiter(id)
  if waiter_of(id) then
    S['nw'] = math.max(S['nw'] - redis.call('HDEL', waiters, id), 0)
    redis.call('ZREM', line_key, id)
    if S['nw'] <= 0 then no_waiters = true end
  end
  Wc[id] = false
  if head_id == id then head_id, head_rec, head_changed = false, nil, true end
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
    local was = Wc[id]
    no_waiters = false
    if was and id == head_id and was[ORDER] == r[ORDER] then
      -- The head, changed in place (a retime, a new reason): its record is the state's
      -- field hd, written with the state; its entry in the waiters' hash is brought up to
      -- date only if it stops being the head while it waits (below), so each retime
      -- costs no write of its own. Every read of the head goes through hd (`head`, the
      -- snapshot: ops.lua).
      Wc[id] = r
      head_rec, head_changed = r, true
      return
    end
    S['nw'] = S['nw'] + redis.call('HSET', waiters, id, rec_encode(r))
    -- A waiter asking again keeps its place: its line entry is already that.
    if not (was and was[ORDER] == r[ORDER]) then redis.call('ZADD', line_key, r[ORDER], id) end
    Wc[id] = r
    -- The head as it stands after this waiter's place (known before it, or read now).
    local hid, h = head()
    if hid == id or not hid or r[ORDER] < h[ORDER] or (r[ORDER] == h[ORDER] and id < hid) then
      -- (The head it displaces waits on behind it: its record, kept in hd, written back.)
      if hid and hid ~= id then redis.call('HSET', waiters, hid, rec_encode(h)) end
      head_id, head_rec, head_changed = id, r, true
    end
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
  if head_changed then
    -- (Not known here, after a forget: the next op reads it from the index.)
    local hid, h = head_id, head_rec
    flat[#flat + 1] = 'hd'
    if hid then flat[#flat + 1] = struct.pack('<H', #hid) .. hid .. rec_encode(h) else flat[#flat + 1] = '' end
    head_changed = false
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
