-- Enqueue, idempotent by id. ARGV: id, payload, delay_ms. Returns 1, or 0 when
-- the id is already queued, in flight or dead.
if q_add(ARGV[1], ARGV[2], q_now() + tonumber(ARGV[3])) then return 1 end
return 0
