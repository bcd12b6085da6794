-- saga_arrive: a transition whose route ends at a barrier: a branch arriving at its join, or a map item.
-- KEYS: the common layout (helpers.lua); KEYS[spec.arrival.k] is the barrier hash, and for a map item
-- KEYS[spec.arrival.bits] its bag's bitmap and KEYS[spec.arrival.list] its results list.
-- Arrivals commute: they check the barrier's own stage fence and the run intent (spec.expects), never a
-- run version, and cost O(1) whatever the size of the bag. A member counts once: HEXISTS on the
-- barrier hash (a join's branches; a bag opened before bags had a bitmap keeps its items there and
-- finishes there), and for a bag its bit in the bitmap. A bag's item result is appended to its list;
-- the release sorts them. The counter lives in the run hash; the arrival that takes it to 0 appends the
-- release message (a deterministic id) to the outbox, so the successor is released exactly once; a
-- bag that sends its items in chunks appends its refill (spec.arrival.refill) the same way. A join's
-- last branch may carry no release: its transition releases the join itself (it completes the join and
-- enters its successor) and expects the counter at 1, so the call that takes it to 0 is that one.
-- The rest of the transition is checked and applied as saga_transition does it (a timer it claims,
-- members that must be absent, expectations; timers it sets or clears, messages it causes, fields it
-- writes): the arrival is one more effect, not a shortcut. Only the applied-id set is not consulted.
-- The message id is not added to the applied set (spec.remember is false): membership is the dedupe,
-- and a bag of 10,000 items must not keep 10,000 ids.
-- Returns {0 APPLIED, remaining, revision} | {1 DUPLICATE} | {2 CONFLICT, field} | {4 NO_RUN} | {5 TIMER_GONE}.
local function arrive(keys, spec)
  local a = spec.arrival
  if redis.call('EXISTS', keys[1]) == 0 then
    if not is_null(spec.claim) then redis.call('ZREM', keys[6], spec.claim) end  -- the run expired
    return {NO_RUN, ''}
  end
  if not timer_claimed(keys, spec) then
    return {TIMER_GONE, ''}
  end
  if any_present(keys, spec.absent) then
    return record_duplicate(keys, spec, nil)
  end
  local failed, status = check_expects(keys[1], spec.expects)
  if failed then
    return {CONFLICT, failed}
  end
  -- A bag's item is looked for in both forms; it is added to the hash while the hash exists, so that
  -- a bag finishes in the form it began.
  local in_hash = is_null(a.bits) or redis.call('EXISTS', keys[a.k]) == 1
  if (in_hash and redis.call('HEXISTS', keys[a.k], a.member) == 1)
    or (not is_null(a.bits) and redis.call('GETBIT', keys[a.bits], tonumber(a.member)) == 1) then
    return record_duplicate(keys, spec, a.stage)
  end
  -- checks done: the writes follow (nothing before this line wrote anything)
  local rev = apply_all(keys, spec, status)
  if in_hash then
    redis.call('HSET', keys[a.k], a.member, a.value)
  else
    redis.call('SETBIT', keys[a.bits], tonumber(a.member), 1)
    redis.call('RPUSH', keys[a.list], a.member .. ':' .. a.value)
  end
  local remaining = redis.call('HINCRBY', keys[1], a.counter, -1)
  if remaining == 0 and not is_null(a.release) then
    append_outbox(keys[4], {a.release})
  end
  -- a bag sending its items in chunks: the arrival that makes `at` of them arrived sends the next one
  -- (the count moves once per distinct item, so exactly one arrival does)
  if not is_null(a.refill) and a.refill[2] - remaining == a.refill[1] then
    append_outbox(keys[4], {a.refill[3]})
  end
  append_history(keys[2], spec.history, spec.at)
  finish(keys, spec)
  return {APPLIED, tostring(remaining), rev}
end
local function saga_arrive(keys, args)
  return arrive(keys, cjson.decode(args[1]))
end
redis.register_function('saga_arrive', saga_arrive)

-- saga_arrive_many: several arrivals of one run (a round's item results of one bag) in one call, each
-- checked and applied exactly as saga_arrive would, one after the other, with its own reply. ARGV[1] is
-- {"arrivals": [their specs]}; KEYS is the run's common layout, the same for all of them. Returns the
-- list of their replies, in order.
local function saga_arrive_many(keys, args)
  local replies = {}
  for i, spec in ipairs(cjson.decode(args[1]).arrivals) do
    replies[i] = arrive(keys, spec)
  end
  return replies
end
redis.register_function('saga_arrive_many', saga_arrive_many)
