-- What a run needs when the queue's scripts end its turn's lease or bury the turn
-- (queue/lib.lua `Q_HOOKS`), and the run helpers those need. Prepended after the queue's
-- library to every queue script of a run store's queue (store.rs `QUEUE_HOOKS`, given to
-- `TurnQueue::with_hooks`) and to the run store's own scripts (before runs/lib.lua).
-- A run's keys sit beside the queue's (the same prefix and slot), named from its id by
-- the shape keys.rs builds them: a queue script learns the id only as it meets the turn.
local RUN_BASE = string.sub(Q_DEAD, 1, #Q_DEAD - #'q:dead')

-- A run status that ends the run (runs/store.lua).
local function run_finished(status)
  return status == 'completed' or status == 'failed' or status == 'cancelled'
end

-- The set of a tenant's unfinished runs beside run record key `run`
-- ('<prefix>:<slot>:tenant:<tenant>:active', keys.rs `tenant_active`), and the run's id:
-- a run joins it when it is created or retried and leaves it when it finishes, in
-- the same script, so a tenant's queue counts are read from its own runs alone.
local function run_active(run, tenant)
  local base, id = string.match(run, '^(.*)run:([^:]+)$')
  return base .. 'tenant:' .. tenant .. ':active', id
end

-- A run's end enqueues its webhook event (runs/webhooks.rs), in the script that ends it:
-- a run never ends without its delivery, and no delivery exists without its run's end.
-- Only a run whose spec named a `webhook_url`. The event's id is the run's and the count
-- of its ends (a re-driven run that ends again is another event); every attempt sends
-- that id. `known`: the run's `webhook_url` when the caller read it already (false or ''
-- for none: no command here, the common case), nil when it did not. The event lives
-- WH_KEEP_MS (its retries' 27.6 h and a dead letter's 7 days, with a margin) even when no
-- worker ever sends it (none holds the secret): nothing it leaves grows without end.
local WH_KEEP_MS = 9 * 24 * 3600 * 1000 -- runs/webhooks.rs EVENT_KEPT
local function webhook_enqueue(run, now, known)
  if known ~= nil and (not known or known == '') then return end
  local url, status, tenant = unpack(redis.call('HMGET', run, 'webhook_url', 'status', 'tenant'))
  if not url or url == '' or not run_finished(status) then return end
  local base, id = string.match(run, '^(.*)run:([^:]+)$')
  local n = redis.call('HINCRBY', run, 'webhook_events', 1)
  local event = 'evt_' .. (string.gsub(id, '^run_', '')) .. '_' .. n
  local key = base .. 'wh:e:' .. event
  -- `origin`: the URL's scheme and authority, what the per-receiver bound counts by
  -- (runs/webhooks.lua's claim).
  redis.call('HSET', key, 'run', id, 'type', 'run.' .. status, 'ms', now, 'url', url,
    'origin', string.match(url, '^[^:/?#]+://[^/?#]*') or '', 'tenant', tenant or '', 'attempts', 0, 'claims', 0,
    'state', 'pending')
  redis.call('PEXPIRE', key, WH_KEEP_MS)
  local due = base .. 'wh:due'
  -- Entries older than any event can live (their hashes expired unsent) leave here.
  redis.call('ZREMRANGEBYSCORE', due, '-inf', now - WH_KEEP_MS)
  redis.call('ZADD', due, now, event)
  -- A token wakes one waiting sender (worker/src/webhooks.rs); a few are enough.
  local wake = base .. 'wh:wake'
  redis.call('RPUSH', wake, 1)
  redis.call('LTRIM', wake, -64, -1)
  redis.call('HSET', run, 'webhook_event', event, 'webhook_state', 'pending', 'webhook_attempts', 0,
    'webhook_last_status', '', 'webhook_next_ms', now, 'webhook_error', '')
end

-- A finished run's record, transcript and events (`run`, `tx`, `ev`) live for
-- `retention` ms, then go (runs/store.lua); it leaves its tenant's unfinished runs.
-- `tenant`: the run's, when the caller read it already (else read here); `set`: fields
-- the caller writes to the record anyway, written with the finish's in one HSET; `webhook`:
-- its `webhook_url` when the caller read it (`webhook_enqueue`'s `known`).
local function run_retire(run, tx, ev, now, retention, tenant, set, webhook)
  if not tenant then tenant = redis.call('HGET', run, 'tenant') end
  if tenant then
    local active, id = run_active(run, tenant)
    redis.call('ZREM', active, id)
  end
  set = set or {}
  for _, v in ipairs({'finished_ms', now, 'updated_ms', now, 'wait_reason', '', 'next_attempt_ms', '', 'phase', ''}) do
    set[#set + 1] = v
  end
  redis.call('HSET', run, unpack(set))
  webhook_enqueue(run, now, webhook)
  local ttl = tonumber(retention)
  if ttl and ttl > 0 then
    redis.call('PEXPIRE', run, ttl)
    redis.call('PEXPIRE', tx, ttl)
    redis.call('PEXPIRE', ev, ttl)
  end
end

-- A lease ended by a queue script (a reclaim, a settle) ends the run store's fence of it
-- (runs/lib.lua `fenced`): the run record names the lease whose start it saw in its
-- `epoch` field, cleared here, so its holder, stalled or late, writes nothing more.
Q_HOOKS.lease_ended = function(id, epoch)
  local run = RUN_BASE .. 'run:' .. id
  if redis.call('HGET', run, 'epoch') == string.format('%d', epoch) then
    redis.call('HSET', run, 'epoch', '')
  end
end

-- A buried turn ends its run, in the same script: it fails with error.kind
-- "dead_lettered", writes run.failed, and starts its retention (the record's
-- retention_ms).
Q_HOOKS.buried = function(id, reason, now)
  local run, ev = RUN_BASE .. 'run:' .. id, RUN_BASE .. 'ev:' .. id
  local status = redis.call('HGET', run, 'status')
  if not status or run_finished(status) then return end
  local message = 'its turn was dead-lettered: ' .. reason
  redis.call('HSET', run, 'status', 'failed', 'error_kind', 'dead_lettered', 'error_message', message, 'epoch', '')
  redis.call('XADD', ev, '*', 'type', 'run.failed',
    'data', cjson.encode({error = {kind = 'dead_lettered', message = message}}))
  run_retire(run, RUN_BASE .. 'tx:' .. id, ev, now, redis.call('HGET', run, 'retention_ms'))
end
