-- Shared local helpers of the saga library. Functions of one library cannot call each other, so every
-- transition uses these; no outbox or history write happens anywhere else.
--
-- Layout of KEYS, the same for every transition function:
--   KEYS[1] run hash        (run fields, and stage fields as "s:<stage>:<field>", barrier counters "b:<stage>")
--   KEYS[2] history stream
--   KEYS[3] applied set     (ids of messages already applied to this run)
--   KEYS[4] shard outbox    (hash: message id -> payload, present while unsent)
--   KEYS[5] shard run index (sorted set: run id by creation time, for listing runs)
--   KEYS[6] shard timers    (sorted set: "<run>|<clock>|<stage>|<fence>" by due time in ms)
--   KEYS[7] shard live runs (hash: plan digest -> runs of it not yet finished)
--   KEYS[8..] the run's barrier hashes (a join's branches; a map opened before bags had the keys below:
--           item -> result), then each map's bitmap of arrived items and its list of "<item>:<result>",
--           all named by index in the spec; after them, for a transition that creates its run or changes
--           its status, the shard's listing indexes it touches (sorted sets: run id by creation time),
--           named by index in spec.index
-- ARGV[1] is the transition spec, JSON (see orchestrator/store/redis_store.py, _spec).

local APPLIED, DUPLICATE, CONFLICT, EXISTS, NO_RUN, TIMER_GONE = 0, 1, 2, 3, 4, 5

local function is_null(v)
  return v == nil or v == cjson.null
end

-- Every expected field and the run's status in one HMGET (one call, not one per field: a transition
-- expects five or six). Returns the first field that does not hold, or nil and the status.
local function check_expects(run, expects)
  local fields = {}
  for i, e in ipairs(expects) do fields[i] = e[1] end
  fields[#expects + 1] = 'status'
  local current = redis.call('HMGET', run, unpack(fields))
  for i, e in ipairs(expects) do
    local want = e[2]
    if is_null(want) then
      if current[i] then return e[1] end
    elseif current[i] ~= want then
      return e[1]
    end
  end
  return nil, current[#expects + 1]
end

-- The run's status once apply_writes has run: the last value spec.sets gives it (HSET keeps the last of
-- a repeated field), else none if spec.dels removes it, else what it was.
local function status_after(spec, before)
  local sets = spec.sets
  for i = #sets - 1, 1, -2 do
    if sets[i] == 'status' then return sets[i + 1] end
  end
  for _, name in ipairs(spec.dels) do
    if name == 'status' then return false end
  end
  return before
end

-- Barrier members that must not have arrived (a bag item's failure after its success): any present makes
-- the message a duplicate. m = {hash, member[, bitmap]}: a bag's item is in its bitmap, or in its hash
-- for a bag opened in that form.
local function any_present(keys, absent)
  for _, m in ipairs(absent) do
    if redis.call('HEXISTS', keys[m[1]], m[2]) == 1 then return true end
    if m[3] and redis.call('GETBIT', keys[m[3]], tonumber(m[2])) == 1 then return true end
  end
  return false
end

local function append_history(stream, entries, at)
  for _, h in ipairs(entries) do
    redis.call('XADD', stream, '*', 'kind', h[1], 'stage', h[2], 'attempt', h[3], 'at', at, 'detail', h[4])
  end
end

local function append_outbox(outbox, entries)
  for _, o in ipairs(entries) do
    redis.call('HSET', outbox, o[1], o[2])
  end
end

local function apply_writes(keys, spec)
  if #spec.dels > 0 then
    redis.call('HDEL', keys[1], unpack(spec.dels))
  end
  if #spec.sets > 0 then
    redis.call('HSET', keys[1], unpack(spec.sets))
  end
  for _, b in ipairs(spec.inits) do
    -- a barrier (re)opened: cleared (a bag's bitmap and results too), its early members added (value
    -- ''), its counter set
    redis.call('DEL', keys[b[1]])
    if b[5] then redis.call('DEL', keys[b[5][1]], keys[b[5][2]]) end
    redis.call('HSET', keys[1], b[2], b[3])
    for _, member in ipairs(b[4]) do
      redis.call('HSET', keys[b[1]], member, '')
    end
  end
end

-- A fired timer acts only if its member is still in the timer set and due: a result that won the race
-- removed it, a heartbeat moved it into the future. Either way the timer has nothing left to do.
local function timer_claimed(keys, spec)
  if is_null(spec.claim) then return true end
  local due = redis.call('ZSCORE', keys[6], spec.claim)
  return due and tonumber(due) <= spec.at
end

local function apply_timers(keys, spec)
  for _, m in ipairs(spec.untimers) do
    redis.call('ZREM', keys[6], m)
  end
  for _, t in ipairs(spec.timers) do
    redis.call('ZADD', keys[6], t[2], t[1])
  end
end

-- Keys shared by every run of the shard (outbox, run index, timers, live runs, listing indexes): never
-- expired with a run.
local function is_shard_key(i, spec)
  return (i >= 4 and i <= 7) or (not is_null(spec.index) and i >= spec.index.first)
end

local function is_live(status)
  return status ~= nil and status ~= false and status ~= 'completed' and status ~= 'failed'
end

-- A run counts in KEYS[7] under its plan digest, and under 'tenant:<its tenant>', from its creation until
-- it ends, and again while a re-drive runs it. The run hash's 'counted' field says it is in the counts
-- ('2': both; '1': the digest's only, a run counted before tenants were), so only a counted run is taken
-- out of them (runs created before a count existed never lower another run's), a definition version
-- shows its runs draining to 0, and a shard admits a tenant's starts against its runs in flight.
local function count_live(keys, before, after)
  local was, now = is_live(before), is_live(after)
  if was == now then return end
  local digest = redis.call('HGET', keys[1], 'digest')
  if not digest then return end
  local tenant = 'tenant:' .. (redis.call('HGET', keys[1], 'tenant') or 'default')
  if now then
    redis.call('HSET', keys[1], 'counted', '2')
    redis.call('HINCRBY', keys[7], digest, 1)
    redis.call('HINCRBY', keys[7], tenant, 1)
    return
  end
  local counted = redis.call('HGET', keys[1], 'counted')
  if not counted then return end
  redis.call('HDEL', keys[1], 'counted')
  if redis.call('HINCRBY', keys[7], digest, -1) <= 0 then redis.call('HDEL', keys[7], digest) end
  if counted == '2' and redis.call('HINCRBY', keys[7], tenant, -1) <= 0 then redis.call('HDEL', keys[7], tenant) end
end

-- The listing indexes (orchestrator/store/facets.py): a run enters its definition's and version's
-- indexes when it is created, and leaves its old status's indexes for its new status's whenever its
-- status changes. spec.index names them only for transitions that can do either.
local function index_status(keys, spec, before, after)
  local ix = spec.index
  if is_null(ix) then return end
  if before == after then return end
  local created = redis.call('HGET', keys[1], 'created_at') or spec.at
  if not before then
    for _, k in ipairs(ix.static) do redis.call('ZADD', keys[k], created, ix.run) end
  elseif ix.by_state[before] then
    for _, k in ipairs(ix.by_state[before]) do redis.call('ZREM', keys[k], ix.run) end
  end
  if after and ix.by_state[after] then
    for _, k in ipairs(ix.by_state[after]) do redis.call('ZADD', keys[k], created, ix.run) end
  end
end

-- Runs whose records have expired leave the indexes a finishing run of the same version names.
local function trim_indexes(keys, spec, bound)
  local ix = spec.index
  if is_null(ix) then return end
  for _, k in ipairs(ix.static) do redis.call('ZREMRANGEBYSCORE', keys[k], '-inf', bound) end
  for _, names in pairs(ix.by_state) do
    for _, k in ipairs(names) do redis.call('ZREMRANGEBYSCORE', keys[k], '-inf', bound) end
  end
end

-- A run that reached its final status announces it on spec.finished (a pub/sub channel; absent where
-- nobody can subscribe): its status, output (the JSON text the run keeps) and reason, what a client
-- waiting for the run returns, so that it learns of the end at once and need not read the run again.
-- An output over 64 KiB is left out (the waiter reads the run): every subscriber's buffer holds it.
-- Called after every write: a PUBLISH refused (a user without channel rights) must not fail a
-- transition whose writes are made, so its error is ignored (pcall) and waits find the end by reading.
local ANNOUNCED_OUTPUT_BYTES = 65536
local function announce(keys, spec)
  if is_null(spec.finished) then return end
  local run = redis.call('HMGET', keys[1], 'status', 'output', 'reason')
  local ending = {state = run[1] or ''}
  if run[2] then
    if #run[2] <= ANNOUNCED_OUTPUT_BYTES then ending.output = run[2] else ending.output_omitted = true end
  end
  if run[3] then ending.reason = run[3] end
  redis.pcall('PUBLISH', spec.finished, cjson.encode(ending))
end

local function finish(keys, spec)
  if spec.expire_ms > 0 then
    -- the listing forgets runs whose records have expired
    local bound = '(' .. (spec.at - spec.expire_ms)
    redis.call('ZREMRANGEBYSCORE', keys[5], '-inf', bound)
    trim_indexes(keys, spec, bound)
    for i = 1, #keys do
      if not is_shard_key(i, spec) then redis.call('PEXPIRE', keys[i], spec.expire_ms) end
    end
  end
  announce(keys, spec)
end

-- Every write of an accepted transition but its history, after all its checks passed; before is the
-- run's status as they read it (false for a run not created yet). Returns the run's revision after it:
-- every transition that writes the run hash counts one (one that only records a refusal writes none), so
-- a process that keeps a run's record between transitions (orchestrator/shard/records.py) can expect the
-- revision it holds and learn of any write it did not make.
local function apply_all(keys, spec, before)
  if spec.persist then
    -- a re-driven run lives again: its keys lose the retention clock its end had started
    for i = 1, #keys do
      if not is_shard_key(i, spec) then redis.call('PERSIST', keys[i]) end
    end
  end
  apply_writes(keys, spec)
  local after = status_after(spec, before)
  count_live(keys, before, after)
  index_status(keys, spec, before, after)
  if spec.remember then redis.call('SADD', keys[3], spec.mid) end
  apply_timers(keys, spec)
  append_outbox(keys[4], spec.outbox)
  if #spec.dels > 0 or #spec.sets > 0 or #spec.inits > 0 or not is_null(spec.arrival) then
    return redis.call('HINCRBY', keys[1], 'rev', 1)
  end
  return tonumber(redis.call('HGET', keys[1], 'rev') or '0')
end

local function commit(keys, spec, before)
  local rev = apply_all(keys, spec, before)
  append_history(keys[2], spec.history, spec.at)
  finish(keys, spec)
  return {APPLIED, spec.mid, rev}
end

local function record_duplicate(keys, spec, stage)
  append_history(keys[2], {{'callback.rejected', stage or '', '', cjson.encode({reason = 'duplicate', message_id = spec.mid})}}, spec.at)
  return {DUPLICATE, spec.mid}
end
