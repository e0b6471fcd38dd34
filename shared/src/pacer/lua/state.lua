-- The shared pacer's atomic operations: the `pacer` crate's model as one Redis script,
-- assembled from the files of this folder in one order (shared/src/pacer/script.rs):
-- state.lua, line.lua, bucket.lua, refund.lua, model.lua, acquire.lua, settle.lua, ops.lua.
--
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
--     (order: its place in line, companion turns < 0 <= work tags; due: when its queue
--      entry is due — the line's timer at the head, a safety deadline behind it; clear:
--      when it is predicted clear)
--   flight: f|tokens|requests|output|mark|expiry|input|sent|alone|ih|oh|omark|rsent|isent|osent|started
--     (expiry: when the reservation lapses; input: the worker's own input estimate, to learn
--      input_ratio from; mark, sent: t_refunded and t_sent when it was sent; ih, oh: what it
--      holds of the input and output buckets; omark: o_refunded when it was sent; rsent,
--      isent, osent: the r_, i_ and o_ sent ledgers when it was sent; alone: 1 when no
--      other call was sent within BURST_GAP_MS of it; started: 1 once its worker has it —
--      0 while the line released it and no fetch started it: reserved, not sent)
-- KEYS[3] line zset: waiter id -> order. The index of the waiters hash, written with it
--   in the same step (put, forget_waiter). Only its head is weighed (kept in the state,
--   field hd); an ask behind it reads its rank (ZCOUNT) for its estimate, and no op reads
--   the turns ahead (but a pacer with no host, whose turns come back at their estimate:
--   acquire.lua, estimate). A waiter never lapses: it leaves when it is released, or when
--   its host no longer holds it (release.lua).
-- KEYS[4] the history's base key (the dashboard's chart, GET /v1/pacer/history): counters
--   only, outside the policy, never read here. One hash per minute, KEYS[4]:<minute>, same
--   hash tag; fields <second>:a (tokens cleared), <second>:r (429s settled), <second>:w
--   (turns told to wait); each expires HIST_TTL_MS after its last write. The minute's key is
--   named here, on the Redis clock; it shares KEYS[4]'s hash tag, so it is in this call's slot.

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
local recheck_min = tonumber(ARGV[13])
-- model.rs, PacingConfig::parks: a host moves the waiting turns (the workers' pacers: the
-- run store's queue). Without one, a waiting turn comes back at its estimate and asks
-- again, and a head not back within the grace (ARGV[12]) of its due time leaves the line.
local parks = ARGV[15] == '1'

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
-- release.rs: the most turns one op releases; a head timer moved only for this gain.
local MAX_RELEASES, RETIME_GAIN_MS = 64, 20
-- acquire.rs, safety_ms: a parked turn's queue entry is due at twice its estimate, within these.
local SAFETY_MIN_MS, SAFETY_MAX_MS, SAFETY_UNKNOWN_MS = 10000, 21600000, 300000
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
local HL_ACCEL_MAX = 2

local function fmt(x) return string.format('%.17g', x) end

-- bucket.rs `Refill`, as a bucket's <p>refill keeps it: not decided yet, continuous, window.
local UNKNOWN, CONTINUOUS, WINDOW = 0, 1, 2
-- model.rs `OwedReason`, as an owed answer and a waiter's record give it.
local OWED_BUDGET, OWED_RATE_LIMITED, OWED_PROBE, OWED_FAIR_SHARE = 1, 2, 3, 4

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
-- The calls in flight as read (field fl), decoded below with the records; and the head of
-- the line as last saved (field hd, line.lua).
local flights_packed, head_packed = nil, nil
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
    elseif k == 'hd' then
      head_packed = raw[i + 1]
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

-- Adds this call's history counts to the state's current second (see `hist`), after
-- moving an earlier second's to its minute's hash.
local function fold_hist()
  if next(hist_counts) == nil then return end
  local sec = math.floor(now / 1000)
  local at = get('h_s')
  if at ~= sec then
    if at > 0 then
      local minute = math.floor(at / 60)
      local key = KEYS[4] .. ':' .. string.format('%d', minute)
      for _, kind in ipairs(HIST_KINDS) do
        local n = get('h_' .. kind)
        if n > 0 then redis.call('HINCRBY', key, string.format('%d:%s', at, kind), string.format('%d', n)) end
      end
      -- The minute's expiry is set by its first fold (h_x: the minute last set), not by
      -- each second's.
      if get('h_x') ~= minute then
        redis.call('PEXPIRE', key, HIST_TTL_MS)
        S['h_x'] = minute
      end
    end
    S['h_s'] = sec
    for _, kind in ipairs(HIST_KINDS) do S['h_' .. kind] = 0 end
  end
  for kind, add in pairs(hist_counts) do S['h_' .. kind] = get('h_' .. kind) + add end
  hist_counts = {}
end
