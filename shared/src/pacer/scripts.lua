-- The shared pacer's atomic operations: model.rs as one Redis script.
--
-- Every check-and-update of a budget is one call of this script, so 16 workers
-- that all saw "remaining: 50 000" cannot each send 20 000 tokens: the first
-- reservation lowers the level the second one sees. Time is the Redis server's
-- clock (TIME), in milliseconds, so workers on different hosts agree. The steps
-- and their names follow model.rs; the differential test keeps the two one policy.
--
-- KEYS[1] state hash. Fields (t_ = token bucket, r_ = request bucket, i_ and o_ = separate input
--   and output token buckets where the provider reports them, as Anthropic does):
--   <p>limit, <p>rate (per ms), <p>level, <p>at (ms), <p>inflight,
--   <p>refunded (cumulative provider refunds), <p>full_at (the provider's reset),
--   <p>charged_since (net charges since the headers that set full_at),
--   <p>rated (1: the rate came from headers), <p>full_seen (when those headers were sent),
--   <p>sent (cumulative charges, corrected at settle), <p>withheld (unused output settled
--   and not credited since the model last met the provider);
--   the bucket's shape (bucket.rs): <p>refill (0 unknown, 1 continuous, 2 window), <p>votes,
--   <p>max_reset (the longest reset seen), <p>obs_at, <p>obs_missing, <p>obs_reset (the last
--   snapshot voted on), <p>boundary (the last reset lifted at), <p>probed (the last probe
--   sent to find the next reset), <p>unknown_credit (the refill counted while the shape was unknown),
--   <p>assumed (1: the limit was inferred from `remaining` alone);
--   blocked_until, probe_until, headerless (1: answers carry no headers and nothing
--   is configured: no proactive pacing until a 429 teaches a bucket), the bucket learned
--   there (model.rs, learn_headerless): hl_used (tokens answered since hl_since), hl_since,
--   hl_cut (the last cut), hl_grow (the last answer), hl_max (the most one answer used), hl_prev and
--   hl_prev_span (after the first cut: what its wave's later answers used, over its span);
--   observed_at, last_admit, usage_ratio, input_ratio
--   (the provider's input count / the workers' estimate), fair_time;
--   the refund learner (refund.rs): rs_given, rs_unused, rs_pairs, its last snapshot
--   rs_at, rs_remaining, rs_sent, rs_refunded, rs_until (the reset it named, 0: none), rs_full
--   (1: it saw the bucket all but full: a window's start, a cold start's probe), and rs_seen
--   (the newest headers seen); call_ms (an answered call's clearance to settle, averaged);
--   last_admit_id (a string, outside the numbers: the call cleared last);
--   per tenant t: tw:<t> weight, tf:<t> finish tag, tc:<t> cap due (ms),
--   tadm:<t> expected tokens admitted, twait:<t> turns that waited.
--   And the calls in flight: field fl, each call's id's length (2 bytes), its
--   reservation id and rec_encode(its record), one after another (the state and the
--   calls in flight are read by every op, so they are one hash: one HGETALL, and one
--   HSET for what an op changed of both; a call that settles costs no HDEL).
-- KEYS[2] waiters hash: reservation id -> rec_encode(a waiter)
--   A record's fields are doubles (the snapshot hands them to Rust as text, in this order,
--   separated by '|'):
--   waiter: w|order|tokens|requests|output|line|due|clear|since|reason|tenant
--     (order: its place in line, companion turns < 0 <= work tags; due: when it may come
--      back, a checkpoint; clear: when it is predicted clear; it lapses at due + grace_ms)
--   flight: f|tokens|requests|output|mark|expiry|input|sent|alone|ih|oh|omark|rsent|isent|osent
--     (expiry: when the reservation lapses; input: the worker's own input estimate, to learn
--      input_ratio from; mark, sent: t_refunded and t_sent when it was cleared; ih, oh: what it
--      holds of the input and output buckets; omark: o_refunded when it was cleared; rsent,
--      isent, osent: the r_, i_ and o_ sent ledgers when it was cleared;
--      alone: 1 when no other call was cleared within BURST_GAP_MS of it)
-- KEYS[3] line zset: waiter id -> order. The index of the waiters hash, written with it
--   in the same step (put, forget_waiter), so an ask reads only the waiters ahead of it,
--   not the whole line. What the turns ahead hold is still summed from their records on
--   every ask: no counter is kept beside them. A waiter lapses where it is read
--   (live_waiter): no index of lapse times is kept (it cost a write at every put and
--   forget).
-- KEYS[4] the history's base key (the dashboard's chart, GET /v1/pacer/history): counters
--   only, outside the policy, never read here. One hash per minute, KEYS[4]:<minute>, same
--   hash tag; fields <second>:a (tokens cleared), <second>:r (429s settled), <second>:w
--   (turns told to wait); each expires HIST_TTL_MS after its last write. The minute's key is
--   named here, on the Redis clock; it shares KEYS[4]'s hash tag, so it is in this call's slot.
-- ARGV[1] op: batch | pull | snapshot
-- ARGV[2..15] config: floor (work turns), max_pace_ms, jitter_frac, jitter_max_ms, ttl_ms,
--          probe_wait_ms, late_ms, tpm, rpm, now in ms ('' = the server's TIME; tests only),
--          grace_ms, recheck_ms, floor (companion turns), whole_waits (1: waits are slept
--          whole and `pull` moves up the waiters near the head; model.rs, pull_in)
-- batch: ARGV[16..] a sequence of ops, each its name and its arguments, decided in order:
--   acquire id, tokens, requests, jitter_u, 'companion' | 'work', tenant weight, tenant cap
--           (0 none), tenant, output tokens reserved
--     -> {0} clear | {1, owed_ms, reason}   reason: 1 budget, 2 rate_limited, 3 probe, 4 fair_share
--   settle  id, used_tokens (-1 unknown), rate_limited_ms (-1 none), token limit, remaining,
--           reset_ms, the same for requests (-1 missing), headers_age_ms, input tokens the
--           provider counted (-1 unknown), input bucket limit, remaining, reset_ms, the same
--           for the output bucket   -> {0}
--   head    n: reads the line's first n waiters for the ops after it (no decision) -> {0}
--   pull    k: the first k waiters in line whose wait, predicted now, ends well before
--           their due time are moved up to it (model.rs, pull_in)
--     -> {id, due_ms, ...} (in a batch only from Lua, runs/fetch.lua: Rust reads integers)
--   -> one answer per op
-- pull: ARGV[16] k[, ARGV[17] n: `head` n first] -> {id, due_ms as text, ...} (the same op alone, for Rust)
-- snapshot: -> flat field list of the state, 'now', and 'rec:<id>' -> record for each record

local state, waiters, line_key = KEYS[1], KEYS[2], KEYS[3]
local op = ARGV[1]
local floor_work, floor_companion = tonumber(ARGV[2]), tonumber(ARGV[14])
local max_pace = tonumber(ARGV[3])
local jitter_frac = tonumber(ARGV[4])
local jitter_max = tonumber(ARGV[5])
local ttl = tonumber(ARGV[6])
local probe_wait = tonumber(ARGV[7])
local late_ms = tonumber(ARGV[8])
local tpm = tonumber(ARGV[9])
local rpm = tonumber(ARGV[10])
local now = tonumber(ARGV[11])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local grace = tonumber(ARGV[12])
local recheck_min = tonumber(ARGV[13])
local whole_waits = tonumber(ARGV[15]) or 0

-- The history: counted here, kept by save() (fold_hist) in the call that decided it (no
-- round trip more). The current second's counts are fields of the state (h_s the second,
-- h_a, h_r, h_w the counts), written in the state's own HSET; the first call of a later
-- second moves them to the minute's hash (one HINCRBY per kind, and the minute's expiry),
-- so the history costs commands once a second, not at every call. history.rs reads both.
local HIST_TTL_MS = 960000
local HIST_KINDS = {'a', 'r', 'w'}
local hist_counts = {}
local function hist(field, n)
  if not KEYS[4] or n <= 0 then return end
  hist_counts[field] = (hist_counts[field] or 0) + math.ceil(n)
end

local COMPANION_BASE = -1e13
local PROBE_HOLD_MS = 10000
local RECHECK_TURNS = 4
local RECHECK_SHARE = 0.75
local RECHECK_TAIL = 4 / 3
local PULL_IN_GAIN_MS = 50
local PULL_IN_PAD_MS = 50
local WHOLE_WAIT_MARGIN = 0.1
local ANSWER_RECHECK_MIN_MS = 50
local BURST_GAP_MS = 60
local SHAPE_VOTES = 2
local MAX_VOTES = 4
local MIN_WINDOW_MS = 1000
local VOTE_MISSING = 0.01
local MIN_VOTE_RESET_MS = 20
local VOTE_AGREE = 0.03
local PROBE_AFTER_LATE = 4
local HL_BURST_MS = 15000
local HL_FIRST_SPAN_MS = 60000
local HL_CUT = 0.9
local HL_CUT_MIN = 0.5
local HL_GROW_PER_MS = 5e-6
local HL_GROW_MAX_MS = 10000
local HL_ACCEL_MS = 20000
local HL_ACCEL_MAX = 4

local function fmt(x) return string.format('%.17g', x) end

-- model.rs's buckets, in one order: tokens, requests, input, output.
local BUCKETS = {'t_', 'r_', 'i_', 'o_'}

-- The state as a table of numbers, and the id of the call cleared last (a string).
-- The numbers every budget has are one field, `n`: the values of FIXED, in its order, as
-- little-endian doubles (reading and writing ~115 fields as text took more of a call's
-- time than its policy). FIXED only grows at its end: a shorter `n` reads as far as it
-- goes. Any other number (each tenant's, below) is a field of its own, written only when
-- it changed; `read` keeps each as it was read, and `packed` the `n` that was read.
-- (A number no one added to FIXED is still kept, as a field of its own.)
local FIXED = {
  't_limit', 't_rate', 't_level', 't_at', 't_inflight', 't_refunded', 't_full_at', 't_charged_since',
  't_rated', 't_full_seen', 't_sent', 't_withheld', 't_refill', 't_votes', 't_max_reset', 't_obs_at',
  't_obs_missing', 't_obs_reset', 't_boundary', 't_probed', 't_unknown_credit', 't_assumed', 'r_limit',
  'r_rate', 'r_level', 'r_at', 'r_inflight', 'r_refunded', 'r_full_at', 'r_charged_since', 'r_rated',
  'r_full_seen', 'r_sent', 'r_withheld', 'r_refill', 'r_votes', 'r_max_reset', 'r_obs_at',
  'r_obs_missing', 'r_obs_reset', 'r_boundary', 'r_probed', 'r_unknown_credit', 'r_assumed', 'i_limit',
  'i_rate', 'i_level', 'i_at', 'i_inflight', 'i_refunded', 'i_full_at', 'i_charged_since', 'i_rated',
  'i_full_seen', 'i_sent', 'i_withheld', 'i_refill', 'i_votes', 'i_max_reset', 'i_obs_at',
  'i_obs_missing', 'i_obs_reset', 'i_boundary', 'i_probed', 'i_unknown_credit', 'i_assumed', 'o_limit',
  'o_rate', 'o_level', 'o_at', 'o_inflight', 'o_refunded', 'o_full_at', 'o_charged_since', 'o_rated',
  'o_full_seen', 'o_sent', 'o_withheld', 'o_refill', 'o_votes', 'o_max_reset', 'o_obs_at',
  'o_obs_missing', 'o_obs_reset', 'o_boundary', 'o_probed', 'o_unknown_credit', 'o_assumed',
  'blocked_until', 'probe_until', 'headerless', 'hl_used', 'hl_since', 'hl_cut', 'hl_grow', 'hl_max',
  'hl_prev', 'hl_prev_span', 'observed_at', 'last_admit', 'usage_ratio', 'input_ratio', 'fair_time',
  'call_ms', 'ttl_at', 'rs_given', 'rs_unused', 'rs_pairs', 'rs_at', 'rs_remaining', 'rs_sent',
  'rs_refunded', 'rs_until', 'rs_full', 'rs_seen'
}
local IS_FIXED = {}
for _, k in ipairs(FIXED) do IS_FIXED[k] = true end
local PACKED = '<' .. string.rep('d', #FIXED)
local S, read = {}, {}
local packed = nil
local last_admit_id, last_admit_changed = nil, false
-- The calls in flight as read (field fl), decoded below with the records.
local flights_packed = nil
do
  local raw = redis.call('HGETALL', state)
  for i = 1, #raw, 2 do
    local k = raw[i]
    if k == 'n' then
      packed = raw[i + 1]
    elseif k == 'last_admit_id' then
      last_admit_id = raw[i + 1]
    elseif k == 'fl' then
      flights_packed = raw[i + 1]
    else
      local x = tonumber(raw[i + 1])
      S[k] = x
      read[k] = x
    end
  end
  if packed then
    local n = math.min(math.floor(#packed / 8), #FIXED)
    local vals = {struct.unpack('<' .. string.rep('d', n), packed)}
    for i = 1, n do S[FIXED[i]] = vals[i] end
  end
end
local function get(k) return S[k] or 0 end

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

-- Adds this call's history counts to the state's current second (see `hist`), after
-- moving an earlier second's to its minute's hash.
local function fold_hist()
  if next(hist_counts) == nil then return end
  local sec = math.floor(now / 1000)
  local at = get('h_s')
  if at ~= sec then
    if at > 0 then
      local key = KEYS[4] .. ':' .. string.format('%d', math.floor(at / 60))
      local fresh = false
      for _, kind in ipairs(HIST_KINDS) do
        local n = get('h_' .. kind)
        if n > 0 then
          local field = string.format('%d:%s', at, kind)
          -- A second's first count (so also a new key's): the key's expiry is set then.
          fresh = redis.call('HINCRBY', key, field, string.format('%d', n)) == n or fresh
        end
      end
      if fresh then redis.call('PEXPIRE', key, HIST_TTL_MS) end
    end
    S['h_s'] = sec
    for _, kind in ipairs(HIST_KINDS) do S['h_' .. kind] = 0 end
  end
  for kind, add in pairs(hist_counts) do S['h_' .. kind] = get('h_' .. kind) + add end
  hist_counts = {}
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

-- bucket.rs
local function known(p) return get(p .. 'limit') > 0 and get(p .. 'rate') > 0 end

-- The continuous refill counted on: none for a window, nor while the shape is unknown.
local function refill_rate(p)
  if get(p .. 'refill') == 2 then return 0 end
  return get(p .. 'rate')
end

local function window_ms(p) return math.max(get(p .. 'max_reset'), 1) end

-- The average refill for what spaces turns (caps, the recheck horizon).
local function share_rate(p)
  if get(p .. 'refill') == 0 then return math.max(get(p .. 'rate'), get(p .. 'limit') / window_ms(p)) end
  return get(p .. 'rate')
end

local function level_at(p, at)
  local elapsed = math.max(at - get(p .. 'at'), 0)
  return math.min(get(p .. 'level') + refill_rate(p) * elapsed, get(p .. 'limit'))
end

-- A bucket without continuous refill whose next reset no headers named: the window after the last lift.
local function guessed_boundary(p)
  if get(p .. 'refill') == 1 or get(p .. 'full_at') > now or get(p .. 'boundary') <= 0 then return nil end
  local window = math.max(window_ms(p), MIN_WINDOW_MS)
  local passed = math.floor((now - get(p .. 'boundary')) / window) + 1
  return get(p .. 'boundary') + math.ceil(passed * window)
end

-- The head may go to find the next reset, once per window.
local function may_probe(p)
  local window = math.floor(math.max(window_ms(p), MIN_WINDOW_MS))
  return get(p .. 'refill') == 2 and get(p .. 'full_at') <= now and now - get(p .. 'boundary') >= window
    and now - get(p .. 'probed') >= window
end

-- A provider that gave back what we withheld would fill to its limit, no further.
local function cap_withheld(p)
  S[p .. 'withheld'] = math.min(get(p .. 'withheld'), math.max(get(p .. 'limit') - get(p .. 'level'), 0))
end

local function advance(p)
  if now > get(p .. 'at') then
    local level = level_at(p, now)
    if get(p .. 'refill') == 0 then
      S[p .. 'unknown_credit'] = get(p .. 'unknown_credit') + math.max(level - get(p .. 'level'), 0)
    end
    S[p .. 'level'] = level
    S[p .. 'at'] = now
  end
  cap_withheld(p)
end

-- Credits (or, negative, takes back) tokens given back to the bucket.
local function credit(p, x)
  S[p .. 'level'] = math.min(get(p .. 'level') + x, math.max(get(p .. 'limit'), get(p .. 'level')))
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
  if shape == 0 then
    return math.min(window_refill_ms(p, short), short / share_rate(p))
  elseif shape == 2 then
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
    if get(p .. 'refill') == 2 then charged = recent end
    S[p .. 'level'] = math.max(get(p .. 'level'), get(p .. 'limit') - charged)
    if get(p .. 'refill') == 2 then S[p .. 'charged_since'] = 0 end
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
      S[p .. 'refill'] = 2
    elseif get(p .. 'votes') <= -SHAPE_VOTES then
      S[p .. 'refill'] = 1
    end
  end
  S[p .. 'obs_at'], S[p .. 'obs_missing'], S[p .. 'obs_reset'] = math.max(at, 1), missing, reset_ms
end

-- The floor kept on a bucket now: in a window, its share of the window still to come
-- (bucket.rs, floor_at).
local function floor_at(p, fl)
  local full_at = get(p .. 'full_at')
  if get(p .. 'refill') == 2 and full_at > now then
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

-- model.rs, PacerState::waits_whole: whole waits and pull-ins, unless a bucket is guessed
-- (learned without headers, or its limit inferred from `remaining` alone).
local function waits_whole()
  if whole_waits ~= 1 or get('headerless') == 1 then return false end
  for _, p in ipairs(BUCKETS) do
    if known(p) and get(p .. 'assumed') == 1 then return false end
  end
  return true
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
  local was_unknown = get(p .. 'refill') == 0
  if has_reset then vote(p, headers_at, missing, reset_ms, limit) end
  -- Nothing says when it refills: a per-minute limit refilling continuously.
  if not has_reset then S[p .. 'refill'] = 1 end
  if get(p .. 'refill') == 2 then
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
  if was_unknown and get(p .. 'refill') ~= 0 then
    -- A window gave nothing back before its boundary: take back the refill counted while unknown.
    if get(p .. 'refill') == 2 then S[p .. 'level'] = get(p .. 'level') - get(p .. 'unknown_credit') end
    S[p .. 'unknown_credit'] = 0
  end
  -- A window's headers from before a boundary that has passed since describe the window that ended.
  if get(p .. 'refill') == 2 and has_reset and headers_at + reset_ms <= now then return end
  local elapsed = math.max(now - headers_at, 0)
  local theirs = math.min(remaining + since + refill_rate(p) * elapsed, limit)
  if theirs < get(p .. 'level') then
    local lowered = get(p .. 'level') - theirs
    S[p .. 'level'] = theirs
    -- Of the refunds withheld, only those given after these headers are still owed; what
    -- these headers lowered the level by may be charges they already counted (a burst):
    -- outside a window it is withheld too, for later headers to give back (bucket.rs).
    if get(p .. 'refill') == 2 then lowered = 0 end
    S[p .. 'withheld'] = math.min(get(p .. 'withheld'), unseen_refunds) + lowered
    if get(p .. 'refill') == 0 then S[p .. 'unknown_credit'] = get(p .. 'rate') * elapsed end
  end
  if has_reset and headers_at >= get(p .. 'full_seen') then
    S[p .. 'full_seen'] = headers_at
    S[p .. 'full_at'] = headers_at + reset_ms
    S[p .. 'charged_since'] = get(p .. 'inflight') + settled_after
  end
end

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

-- model.rs
-- Drops the calls past their reservation's TTL (waiters lapse where they are read).
-- Once per `now`: what an op of the same batch puts lapses later (TTL > 0).
local expired_at = nil
local function expire()
  if expired_at == now and ttl > 0 and grace >= 0 then return end
  expired_at = now
  for id, r in pairs(F) do
    if r[EXPIRY] <= now then
      local held = {r[TOKENS], r[REQUESTS], r[IH], r[OH]}
      for i, p in ipairs(BUCKETS) do S[p .. 'inflight'] = math.max(get(p .. 'inflight') - held[i], 0) end
      drop(id)
    end
  end
  -- (Waiters lapse where they are read: live_waiter.)
end

-- Lifts both buckets at their reset; a window's lift subtracts what was
-- cleared within late_ms before its boundary (it may have arrived after).
local function lift_all()
  local recent = {t_ = 0, r_ = 0, i_ = 0, o_ = 0}
  local lifts, any = {}, false
  for _, p in ipairs(BUCKETS) do
    lifts[p] = get(p .. 'refill') == 2 and get(p .. 'full_at') > 0 and now >= get(p .. 'full_at')
    any = any or lifts[p]
  end
  if any then
    for _, f in pairs(F) do
      do
        local held = {f[TOKENS], f[REQUESTS], f[IH], f[OH]}
        for j, p in ipairs(BUCKETS) do
          if lifts[p] and f[EXPIRY] - ttl >= get(p .. 'full_at') - late_ms then recent[p] = recent[p] + held[j] end
        end
      end
    end
  end
  for _, p in ipairs(BUCKETS) do lift(p, recent[p]) end
  if lifts['t_'] then
    refund_window_start(get('t_boundary'), get('t_limit') - recent['t_'], get('t_sent'), get('t_refunded'),
      get('t_boundary') + math.floor(get('t_max_reset')))
  end
end

local function line_cost(tokens, out)
  local ratio = get('usage_ratio')
  if ratio <= 0 then ratio = 1 end
  ratio = math.min(math.max(ratio, 0.05), 1)
  local input, output = tokens, tokens
  if out > 0 then output = math.min(out, tokens) end
  input = tokens - output
  local kept = ratio + (1 - ratio) * (1 - refund_share(1))
  return math.ceil(input + output * kept)
end

local function owed(ms, reason, u)
  local base = math.max(math.ceil(ms), 1)
  local jitter = math.min(base * jitter_frac, jitter_max) * math.min(math.max(u, 0), 1)
  hist('w', 1)
  return {1, math.ceil(base + jitter), reason}
end

local function tenant_entry(t)
  if S['tw:' .. t] == nil then S['tw:' .. t] = 0 end
end

if op == 'snapshot' then
  expire()
  save()
  local out = {}
  for k, v in pairs(S) do
    out[#out + 1] = k
    out[#out + 1] = fmt(v)
  end
  out[#out + 1] = 'now'
  out[#out + 1] = tostring(now)
  for id, r in pairs(F) do
    out[#out + 1] = 'rec:' .. id
    out[#out + 1] = rec_text(r)
  end
  local raw = redis.call('HGETALL', waiters)
  for i = 1, #raw, 2 do
    -- (A waiter that lapsed is not in line: live_waiter.)
    local w = live_waiter(raw[i], raw[i + 1])
    if w then
      out[#out + 1] = 'rec:' .. raw[i]
      out[#out + 1] = rec_text(w)
    end
  end
  return out
end

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

-- A call's report for reservation a[1]: [2] used_tokens (-1 unknown), [3] rate_limited_ms
-- (-1 none), [4..6] token limit, remaining, reset_ms, [7..9] same for requests (-1 missing),
-- [10] headers_age_ms, [11] input tokens the provider counted (-1 unknown), [12..14] input
-- bucket limit, remaining, reset_ms, [15..17] same for the output bucket.
local function settle(a)
  local id = a[1]
  local used = tonumber(a[2])
  local limited = tonumber(a[3])
  local counted = tonumber(a[11])
  expire()
  ensure_configured()
  local tk, rq, out, mark, estimated_input, sent_mark = 0, 0, 0, nil, 0, 0
  local held = {0, 0, 0, 0}
  local rec = F[id] or waiter_of(id)
  if rec and rec[KIND] == 'f' then
    tk, rq, out, mark, estimated_input, sent_mark = rec[TOKENS], rec[REQUESTS], rec[OUTPUT], rec[MARK], rec[INPUT], rec[SENT]
    held = {rec[TOKENS], rec[REQUESTS], rec[IH], rec[OH]}
  end
  drop(id)
  if mark then S['probe_until'] = 0 end
  local output = tk
  if out > 0 then output = math.min(out, tk) end
  local input = tk - output
  -- What the reservation was off by: its input part (the provider charged the
  -- input it counted), and the output left unused (given back in the learned share).
  local input_fix, unused = 0, 0
  if limited < 0 and used >= 0 then
    if counted >= 0 and out > 0 then
      input_fix, unused = input - counted, math.max(counted + output - used, 0)
    else
      unused = math.max(tk - used, 0)
    end
  end
  if limited < 0 and counted >= 0 and estimated_input > 0 then
    local seen = math.min(math.max(counted / estimated_input, 0.25), 4)
    local prior = get('input_ratio')
    if prior <= 0 then prior = seen end
    S['input_ratio'] = 0.7 * prior + 0.3 * seen
  end
  if limited < 0 and mark then
    -- An answered call's time, clearance to settle: the first taken whole.
    local seen = math.max(now - (rec[EXPIRY] - ttl), 0)
    local prior = get('call_ms')
    if prior <= 0 then prior = seen end
    S['call_ms'] = 0.8 * prior + 0.2 * seen
  end
  if limited < 0 and used >= 0 then
    -- The output reservation: on the combined bucket, or (split) on the output bucket.
    local u_input, u_output = input, output
    if mark and tk == 0 and held[4] > 0 then u_input, u_output = held[3], held[4] end
    if counted >= 0 then u_input = counted end
    if u_output > 0 then
      local seen = math.min(math.max((used - u_input) / u_output, 0), 1)
      local prior = get('usage_ratio')
      if prior <= 0 then prior = math.max(seen, 0.05) end
      S['usage_ratio'] = 0.8 * prior + 0.2 * seen
    end
  end
  -- A reset that passed since the last ask is lifted before these headers name the next one.
  lift_all()
  local share = refund_share(0)
  -- What others left unused since this call was sent, and what was cleared after it
  -- (only calls cleared later than a burst of it are surely not in its headers), and
  -- what was cleared after it and has settled already (in the ledgers, no longer in flight).
  local others, others_out = 0, 0
  local after, settled_after = {0, 0, 0, 0}, {0, 0, 0, 0}
  -- With no bucket known every call in flight holds nothing: the scans below would add
  -- zeros (a provider without headers or limits, where each settle counts).
  local scan = any_known()
  if mark then
    others = math.max(get('t_refunded') - mark, 0)
    others_out = math.max(get('o_refunded') - rec[OMARK], 0)
    local later = {0, 0, 0, 0}
    if scan then
      local e = rec[EXPIRY]
      for _, g in pairs(F) do
        if g[EXPIRY] > e then
          later[1], later[2], later[3], later[4] =
            later[1] + g[TOKENS], later[2] + g[REQUESTS], later[3] + g[IH], later[4] + g[OH]
          if g[EXPIRY] - e > BURST_GAP_MS then
            after[1], after[2], after[3], after[4] =
              after[1] + g[TOKENS], after[2] + g[REQUESTS], after[3] + g[IH], after[4] + g[OH]
          end
        end
      end
    end
    local marks = {rec[SENT], rec[RSENT], rec[ISENT], rec[OSENT]}
    for j, p in ipairs(BUCKETS) do
      settled_after[j] = math.max(get(p .. 'sent') - marks[j] - later[j], 0)
    end
  end
  -- The separate input and output buckets: the input charged as the provider counted
  -- it; the output reservation's unused part given back when the answer is done.
  local in_fix, out_unused = 0, 0
  if counted >= 0 and held[3] > 0 then in_fix = held[3] - counted end
  if limited < 0 and used >= 0 and counted >= 0 and held[4] > 0 then
    out_unused = math.max(held[4] - (used - counted), 0)
  end
  local headers_at = now - tonumber(a[10])
  local obs = {
    {tonumber(a[4]), tonumber(a[5]), tonumber(a[6])},
    {tonumber(a[7]), tonumber(a[8]), tonumber(a[9])},
    {tonumber(a[12]), tonumber(a[13]), tonumber(a[14])},
    {tonumber(a[15]), tonumber(a[16]), tonumber(a[17])},
  }
  -- A window whose boundary went by while no headers named it: the first headers from
  -- the window that began name the next boundary, a window later; the bucket was full
  -- at the one between, less what was cleared since (this call among them).
  local cleared_at = nil
  if mark then cleared_at = rec[EXPIRY] - ttl end
  local flights = {}
  if scan then
    for _, g in pairs(F) do flights[#flights + 1] = g end
  end
  for j, p in ipairs(BUCKETS) do
    local reset = obs[j][3]
    local window = get(p .. 'max_reset')
    if get(p .. 'refill') == 2 and reset >= 0 then
      local start = headers_at + reset - math.floor(window)
      if window > 0 and get(p .. 'full_at') <= now and start <= now and start > get(p .. 'boundary') + window / 2 then
        local since = start - late_ms
        local recent = 0
        for _, g in ipairs(flights) do
          local gh = {g[TOKENS], g[REQUESTS], g[IH], g[OH]}
          if g[EXPIRY] - ttl >= since then recent = recent + gh[j] end
        end
        if cleared_at and cleared_at >= since then recent = recent + held[j] end
        advance(p)
        S[p .. 'level'] = math.max(get(p .. 'level'), get(p .. 'limit') - recent)
        S[p .. 'boundary'] = start
        S[p .. 'charged_since'] = 0
      end
    end
  end
  -- How high a refund can have lifted each bucket (model.rs, refund_cap): its limit,
  -- plus the refill since a moment after this call was cleared, less what was cleared
  -- after that moment, at the least over the moments the calls in flight were cleared.
  local caps = {1e308, 1e308, 1e308, 1e308}
  if cleared_at then
    for j, p in ipairs(BUCKETS) do
      if known(p) then
        local since = cleared_at
        if get(p .. 'refill') == 2 then since = math.max(cleared_at, get(p .. 'boundary') - late_ms) end
        -- The calls cleared later, newest first; those cleared at one moment count
        -- together (the least falls on the last of them, whatever their order).
        local field = HELD_FIELDS[j]
        local sums, ats = {}, {}
        for _, g in ipairs(flights) do
          local at, x = g[EXPIRY] - ttl, g[field]
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
  end
  -- A call cleared just before a window's boundary was charged to the new window at
  -- its lift; its headers tell which window it went into.
  local old_window = {false, false, false, false}
  if mark then
    local cleared = rec[EXPIRY] - ttl
    for j, p in ipairs(BUCKETS) do
      local b = get(p .. 'boundary')
      if get(p .. 'refill') == 2 and obs[j][3] >= 0 and cleared < b and cleared >= b - late_ms
        and headers_at + obs[j][3] < b + get(p .. 'max_reset') / 2 then
        old_window[j] = true
      end
    end
  end
  -- Per bucket: what it held, the input fix, the unused output, the share of it
  -- credited (the output bucket gives it all back), and what of it is withheld:
  -- the part not credited (model.rs).
  local per = {
    {held[1], input_fix, unused, share, unused * math.max(1 - share, 0)},
    {held[2], 0, 0, 0, 0},
    {held[3], in_fix, 0, 0, 0},
    {held[4], 0, out_unused, 1, 0},
  }
  for j, p in ipairs(BUCKETS) do
    local h, fix, u, sh, withhold = per[j][1], per[j][2], per[j][3], per[j][4], per[j][5]
    if old_window[j] and limited < 0 then
      S[p .. 'level'] = math.min(get(p .. 'level') + h, math.max(get(p .. 'limit'), get(p .. 'level')))
    end
    advance(p)
    S[p .. 'inflight'] = math.max(get(p .. 'inflight') - h, 0)
    -- A refused call's whole reservation comes back, to us and to the ledger.
    if limited >= 0 then fix = h end
    credit(p, fix)
    credit_refund(p, sh * u, caps[j])
    S[p .. 'sent'] = get(p .. 'sent') - fix
    S[p .. 'refunded'] = get(p .. 'refunded') + u
    if withhold > 0 then S[p .. 'withheld'] = get(p .. 'withheld') + withhold end
    cap_withheld(p)
  end
  local since = {share * (unused + others) - after[1], -after[2], -after[3], out_unused + others_out - after[4]}
  for j, p in ipairs(BUCKETS) do
    local own = held[j]
    if limited >= 0 then own = 0 end
    local unseen = 0
    if j == 1 then unseen = unused + others end
    observe(p, obs[j][1], obs[j][2], obs[j][3], headers_at, since[j], own, settled_after[j], unseen)
  end
  -- The refund learner takes the answer's token headers (from a call cleared
  -- alone); once the share is known, the refunds withheld while it was not are
  -- credited as the newest headers confirm them (model.rs, learn_refund_share).
  -- (A limit inferred from remaining alone learns nothing here.)
  local t_limit, t_remaining, t_reset = obs[1][1], obs[1][2], obs[1][3]
  if mark and t_limit >= 0 and t_remaining >= 0 and known('t_') and t_limit == get('t_limit') and t_reset <= max_pace then
    local remaining = math.min(t_remaining, t_limit)
    local newest = headers_at > get('rs_seen')
    S['rs_seen'] = math.max(get('rs_seen'), headers_at)
    if rec[ALONE] == 1 then
      -- A pair must not span the reset these headers name, unless the bucket is known continuous.
      local until_ms = 0
      if get('t_refill') ~= 1 and t_reset >= 0 then until_ms = headers_at + t_reset end
      -- A refused call was charged nothing: its own charge is not in its headers.
      local sent = sent_mark
      if limited >= 0 then sent = sent_mark - tk end
      refund_learn(headers_at, remaining, sent, mark, until_ms)
    end
    local known_share = refund_share(-1)
    if limited < 0 and known_share >= 0 then
      -- (A share of nought drops nothing withheld: model.rs, learn_refund_share.)
      if newest and get('t_withheld') > 0 then
        advance('t_')
        local elapsed = math.max(now - headers_at, 0)
        local pending = 0
        for _, o in pairs(F) do
          if o[SENT] < sent_mark then pending = pending + o[TOKENS] else pending = pending + o[OUTPUT] end
        end
        local theirs = math.min(remaining + known_share * unused + refill_rate('t_') * elapsed, get('t_limit'))
          - math.max(get('t_sent') - sent_mark, 0) - pending
        local owed_credit = math.min(get('t_withheld'), math.max(theirs - get('t_level'), 0))
        -- Not credit(): these refunds came before the headers that set the reset.
        S['t_level'] = math.min(get('t_level') + owed_credit, math.max(get('t_limit'), get('t_level')))
        S['t_withheld'] = math.max(get('t_withheld') - owed_credit, 0)
      end
    end
  end
  if obs[1][2] >= 0 or obs[2][2] >= 0 or obs[3][2] >= 0 or obs[4][2] >= 0 then
    S['observed_at'] = now
    S['probe_until'] = 0
    S['headerless'] = 0
  elseif mark and not any_known() then
    -- Answered without headers and nothing configured: no proactive pacing.
    S['headerless'] = 1
  end
  if get('headerless') == 1 and mark then
    -- The bucket of a budget without headers, learned from its 429s (model.rs, learn_headerless).
    local cleared = rec[EXPIRY] - ttl
    if get('hl_since') == 0 then S['hl_since'] = cleared end
    if limited < 0 then
      local u = tk
      if used >= 0 then u = used end
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
  if limited >= 0 then
    hist('r', 1)
    S['blocked_until'] = math.max(get('blocked_until'), headers_at + limited)
    for j, p in ipairs(BUCKETS) do
      if known(p) and obs[j][2] < 0 then S[p .. 'level'] = math.min(get(p .. 'level'), 0) end
    end
  end
  return {0}
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

if op == 'pull' then
  if tonumber(ARGV[17]) then read_head(tonumber(ARGV[17])) end
  local out = pull_in(tonumber(ARGV[16]) or 0)
  save()
  for j = 2, #out, 2 do out[j] = string.format('%d', out[j]) end
  return out
end

-- A batch of asks and reports, in order, each as it would be alone at this `now`
-- (store.rs sends a process's concurrent calls of one budget and model together):
-- ARGV[16..] is each op's name and then its arguments (acquire: 9, settle: 17, pull: 1,
-- head: 1, fresh: 1, a reservation never asked for). The
-- state and the records are read once and written once, by save(), for the whole batch.
-- -> one reply per op: acquire {0} clear | {1, owed_ms, reason}; settle {0}.
if op == 'batch' then
  local out = {}
  local i = 16
  while i <= #ARGV do
    local name = ARGV[i]
    if name == 'acquire' then
      out[#out + 1] = acquire({unpack(ARGV, i + 1, i + 9)})
      i = i + 10
    elseif name == 'settle' then
      out[#out + 1] = settle({unpack(ARGV, i + 1, i + 17)})
      i = i + 18
    elseif name == 'pull' then
      out[#out + 1] = pull_in(tonumber(ARGV[i + 1]) or 0)
      i = i + 2
    elseif name == 'head' then
      read_head(tonumber(ARGV[i + 1]) or 0)
      out[#out + 1] = {0}
      i = i + 2
    elseif name == 'fresh' then
      -- Reservation ARGV[i + 1] was never asked for (a commit's ask for its next turn,
      -- store.lua): it has no waiter record, and its ask reads none.
      Wc[ARGV[i + 1]] = false
      out[#out + 1] = {0}
      i = i + 2
    else
      return redis.error_reply('unknown pacer op ' .. tostring(name))
    end
  end
  save()
  return out
end

return redis.error_reply('unknown pacer op ' .. tostring(op))
