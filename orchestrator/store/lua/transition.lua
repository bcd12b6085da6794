-- saga_transition: apply one decided transition under compare-and-set.
-- KEYS: the common layout (helpers.lua). ARGV[1]: the spec.
-- Checks, in order and before any write: the run exists, the message was not applied before, every
-- expected field still holds. Then writes fields, initialises barriers, appends outbox and history.
-- A fired timer (spec.claim) must still be in the timer set and due, else nothing happens.
-- Returns {0 APPLIED, mid, revision} | {1 DUPLICATE} | {2 CONFLICT, field} | {4 NO_RUN} | {5 TIMER_GONE}.
-- Also used for intent, finaliser progress and recording rejected (late, stale) callbacks.
local function saga_transition(keys, args)
  local spec = cjson.decode(args[1])
  if redis.call('EXISTS', keys[1]) == 0 then
    if not is_null(spec.claim) then redis.call('ZREM', keys[6], spec.claim) end  -- the run expired
    return {NO_RUN, ''}
  end
  if not timer_claimed(keys, spec) then
    return {TIMER_GONE, ''}
  end
  if redis.call('SISMEMBER', keys[3], spec.mid) == 1 then
    return record_duplicate(keys, spec, nil)
  end
  if any_present(keys, spec.absent) then
    return record_duplicate(keys, spec, nil)
  end
  local failed, status = check_expects(keys[1], spec.expects)
  if failed then
    return {CONFLICT, failed}
  end
  return commit(keys, spec, status)
end
redis.register_function('saga_transition', saga_transition)
