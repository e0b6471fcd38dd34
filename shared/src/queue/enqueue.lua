-- Enqueue, idempotent by id. ARGV: id, payload, delay_ms. Returns 1, or 0 when
-- the id is already queued, in flight or dead.
local id = ARGV[1]
if redis.call('HSETNX', Q_JOBS, id, '0|0|q|' .. ARGV[2]) == 0 then return 0 end
redis.call('ZADD', Q_DUE, q_now() + tonumber(ARGV[3]), id)
q_wake()
return 1
