-- saga_arrive: a branch or map item arriving at a barrier.
-- KEYS: the common layout (helpers.lua); KEYS[spec.arrival.k] is the barrier hash.
-- Arrivals commute: they check the barrier's own stage fence and the run intent (spec.expects), never a
-- run version, and cost O(1) whatever the size of the bag. A member counts once: HSETNX on the barrier
-- hash. The counter lives in the run hash; the arrival that takes it to 0 appends the release message
-- (a deterministic id) to the outbox, so the successor is released exactly once.
-- The message id is not added to the applied set: membership is the dedupe, and a bag of 10,000 items
-- must not keep 10,000 ids.
-- Returns {0 APPLIED, remaining} | {1 DUPLICATE} | {2 CONFLICT, field} | {4 NO_RUN}.
local function saga_arrive(keys, args)
  local spec = cjson.decode(args[1])
  local a = spec.arrival
  if redis.call('EXISTS', keys[1]) == 0 then
    return {NO_RUN, ''}
  end
  local failed = check_expects(keys[1], spec.expects)
  if failed then
    return {CONFLICT, failed}
  end
  if redis.call('HEXISTS', keys[a.k], a.member) == 1 then
    return record_duplicate(keys, spec, a.stage)
  end
  if #spec.sets > 0 then
    -- the arriving stage's own fields (its status and result): no other branch writes them
    redis.call('HSET', keys[1], unpack(spec.sets))
  end
  redis.call('HSET', keys[a.k], a.member, a.value)
  local remaining = redis.call('HINCRBY', keys[1], a.counter, -1)
  if remaining == 0 then
    append_outbox(keys[4], {a.release})
  end
  append_history(keys[2], spec.history, spec.at)
  return {APPLIED, tostring(remaining)}
end
redis.register_function('saga_arrive', saga_arrive)
