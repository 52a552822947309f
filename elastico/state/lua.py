"""Lua scripts run atomically inside Redis. Keys are built from the prefix passed as ARGV[1]
(see ``elastico.state.keys``: all keys share one hash tag, so one slot)."""

# The body of one transaction (see elastico.state.transaction.Transaction), shared by APPLY and APPLY_EACH.
# Records (job JSON, placement JSON) travel as their own ARGV entries, named by index (``data_arg``) in
# the transaction JSON: no JSON-in-JSON escaping to encode in the client and decode in the script.
# Every check runs before the first write, so a transaction that fails writes nothing. A job write with
# ``index_seq`` is added to the job index scored by the next submission sequence number (INCR here, after
# the checks: a rejected submission consumes no number).
#
# Job indexes (keys.py), kept here in the same atomic step as the record, with no command beyond the ones a
# write already used (SADD/SREM/ZADD: the allocator's Redis ACL needs nothing new for job writes):
#   jobs                          zset, every job by submission sequence            (created)
#   jobs:tenant:<t>               zset, the tenant's jobs by sequence               (created)
#   jobs:active                   set, non-terminal jobs                            (every state change)
#   jobs:tenant:<t>:active        zset, the tenant's non-terminal jobs by sequence  (every write; counted by a
#                                 creation with ``live_limit``: refused at that many, 'tenant_limit')
#   jobs:state:<s>                zset, terminal state s by sequence                (entering s)
#   jobs:tenant:<t>:state:<s>     zset, the tenant's jobs in terminal state s       (entering s)
#   jobs:finished                 zset, terminal jobs by finish time (unix s)       (entering a terminal state)
# A created record also gets the fields seq, tenant and request_id (what the list and sweep scripts read).
# Nothing is ever removed from a terminal index here (that needs ZREM): a job leaving a terminal state (no
# service does that) leaves a stale entry, which LIST_JOBS skips (it checks every candidate's current state)
# and SWEEP removes. A record without ``seq`` predates the indexes: SWEEP's backfill indexes it.
_TERMINAL = r"""
local TERMINAL = {succeeded = true, failed = true, cancelled = true}
"""

_APPLY_ONE = _TERMINAL + r"""
local p = ARGV[1]
local function apply(tx)
  if tx.epoch ~= cjson.null then
    local cur = tonumber(redis.call('GET', p .. 'leader:epoch') or '0')
    if cur ~= tx.epoch then return {'stale_epoch', tostring(cur)} end
  end
  if tx.claim_request ~= cjson.null then
    local owner = redis.call('HGET', p .. 'requests', tx.claim_request[1])
    if owner then return {'duplicate', owner} end
  end
  local olds = {}
  for i, w in ipairs(tx.jobs) do
    local cur = redis.call('HMGET', p .. 'job:' .. w.job_id, 'version', 'state', 'seq', 'tenant')
    local v = tonumber(cur[1] or '0')
    if v ~= w.expected_version then return {'version', w.job_id, tostring(v), tostring(w.expected_version)} end
    olds[i] = cur
  end
  for _, w in ipairs(tx.jobs) do
    if w.live_limit and w.live_limit > 0 then
      local live = redis.call('ZCARD', p .. 'jobs:tenant:' .. w.tenant .. ':active')
      if live >= w.live_limit then return {'tenant_limit', w.tenant, tostring(live)} end
    end
  end
  local pending = {}
  local order = {}
  for _, d in ipairs(tx.gpus) do
    local k = p .. 'gpu:' .. d.node_id .. ':' .. string.format('%d', d.gpu_index)
    local u = pending[k]
    if not u then
      if redis.call('EXISTS', k) == 0 then return {'unknown_gpu', d.node_id .. ':' .. string.format('%d', d.gpu_index)} end
      local vals = redis.call('HMGET', k, 'share_cap', 'mem_cap', 'share_used', 'mem_used')
      u = {tonumber(vals[1] or '0'), tonumber(vals[2] or '0'), tonumber(vals[3] or '0'), tonumber(vals[4] or '0')}
      pending[k] = u
      table.insert(order, k)
    end
    u[3] = u[3] + d.share_units
    u[4] = u[4] + d.mem_mib
    if (d.share_units > 0 and u[3] > u[1]) or (d.mem_mib > 0 and u[4] > u[2]) then
      return {'capacity', d.node_id .. ':' .. string.format('%d', d.gpu_index)}
    end
  end
  -- every check passed: write
  if tx.claim_request ~= cjson.null then
    redis.call('HSET', p .. 'requests', tx.claim_request[1], tx.claim_request[2])
  end
  for i, w in ipairs(tx.jobs) do
    local k = p .. 'job:' .. w.job_id
    redis.call('HSET', k, 'data', ARGV[w.data_arg], 'version', string.format('%d', w.new_version), 'state', w.state)
    local old_state, seq, tenant = olds[i][2], olds[i][3], olds[i][4]
    local created = nil
    if w.index_score ~= cjson.null then
      created = string.format('%d', w.index_score)
    elseif w.index_seq then
      local n = redis.call('INCR', p .. 'jobs:seq')
      if n == 1 then redis.call('SET', p .. 'jobs:indexed', '1') end  -- a new namespace: indexed from the start
      created = string.format('%d', n)
    end
    if created then
      seq, tenant = created, w.tenant
      redis.call('HSET', k, 'seq', seq, 'tenant', tenant, 'request_id', w.request_id)
      redis.call('ZADD', p .. 'jobs', seq, w.job_id)
      redis.call('ZADD', p .. 'jobs:tenant:' .. tenant, seq, w.job_id)
    end
    if TERMINAL[w.state] then
      redis.call('SREM', p .. 'jobs:active', w.job_id)
      if tenant then redis.call('ZREM', p .. 'jobs:tenant:' .. tenant .. ':active', w.job_id) end
      if seq and tenant and old_state ~= w.state then
        redis.call('ZADD', p .. 'jobs:state:' .. w.state, seq, w.job_id)
        redis.call('ZADD', p .. 'jobs:tenant:' .. tenant .. ':state:' .. w.state, seq, w.job_id)
        redis.call('ZADD', p .. 'jobs:finished', w.time_s, w.job_id)
      end
    else
      redis.call('SADD', p .. 'jobs:active', w.job_id)
      if seq and tenant then redis.call('ZADD', p .. 'jobs:tenant:' .. tenant .. ':active', seq, w.job_id) end
    end
  end
  for _, k in ipairs(order) do
    local u = pending[k]
    redis.call('HSET', k, 'share_used', string.format('%d', math.max(0, u[3])), 'mem_used', string.format('%d', math.max(0, u[4])))
  end
  for _, op in ipairs(tx.desired) do
    if op.data_arg == cjson.null then
      redis.call('HDEL', p .. 'desired:' .. op.node_id, op.job_id)
    else
      redis.call('HSET', p .. 'desired:' .. op.node_id, op.job_id, ARGV[op.data_arg])
    end
    redis.call('INCR', p .. 'desired:' .. op.node_id .. ':gen')
  end
  for _, e in ipairs(tx.events) do
    redis.call('XADD', p .. 'events', 'MAXLEN', '~', ARGV[3], '*', 'job_id', e.job_id, 'state', e.state,
               'reason', e.reason, 'message', e.message, 'version', string.format('%d', e.version), 'time_s', e.time_s)
  end
  return nil
end
"""

# ARGV[1] = key prefix, ARGV[2] = JSON Transaction, ARGV[3] = event stream MAXLEN, ARGV[4..] = records.
# Returns nil on success or {error_kind, detail...}; on error nothing has been written.
APPLY = _APPLY_ONE + r"""
return apply(cjson.decode(ARGV[2]))
"""

# ARGV[1] = key prefix, ARGV[2] = JSON list of Transactions, ARGV[3] = event stream MAXLEN, ARGV[4..] = records.
# Applies each transaction on its own, in order (a later one sees the earlier ones' writes): returns one
# entry per transaction, {'ok'} or its {error_kind, detail...}; a failed one writes nothing and does not
# stop the others. (The whole script is one atomic step, but callers rely only on each entry's atomicity.)
APPLY_EACH = _APPLY_ONE + r"""
local out = {}
for i, tx in ipairs(cjson.decode(ARGV[2])) do
  out[i] = apply(tx) or {'ok'}
end
return out
"""

# ARGV[1] = key prefix. The data of every job in the active set, in one step (what a round reads).
ACTIVE_JOBS = r"""
local p = ARGV[1]
local ids = redis.call('SMEMBERS', p .. 'jobs:active')
local out = {}
for i, id in ipairs(ids) do
  out[i] = redis.call('HGET', p .. 'job:' .. id, 'data') or false
end
return out
"""

# ARGV[1] = key prefix, ARGV[2] = sequence to list below ('' = from the newest), ARGV[3] = rows wanted (>= 1),
# ARGV[4] = tenant ('' = every tenant), ARGV[5..] = states (none = every state). One page of ListJobs, newest
# first, in one step, reading only the matching index entries: no filter -> ``jobs``; a tenant -> its zset;
# terminal states -> their zsets (the tenant's, with a tenant); non-terminal states -> ``jobs:active`` (every
# active record's state, seq and tenant fields: O(active)). The candidates are merged by sequence; at most
# wanted + 1 of them are checked against the current record (state, tenant: a stale entry is skipped) and
# the matching ones returned.
# Returns {'ok', cursor, more, {seq, data, seq, data, ...}}: cursor = the sequence of the last candidate
# checked ('' = none), more = 1 when candidates below it may remain (call again from the cursor). A filtered
# call on a namespace whose records predate the indexes (not backfilled yet) returns {'unindexed'}.
LIST_JOBS = _TERMINAL + r"""
local p = ARGV[1]
local want = tonumber(ARGV[3])
local tenant = ARGV[4]
if (tenant ~= '' or #ARGV > 4) and not redis.call('GET', p .. 'jobs:indexed')
    and redis.call('EXISTS', p .. 'jobs:seq') == 1 then
  return {'unindexed'}
end
local top = ARGV[2] == '' and '+inf' or '(' .. ARGV[2]
local below = ARGV[2] == '' and math.huge or tonumber(ARGV[2])
local n = want + 1
local wanted, any_active = nil, false
if #ARGV > 4 then
  wanted = {}
  for i = 5, #ARGV do
    wanted[ARGV[i]] = true
    if not TERMINAL[ARGV[i]] then any_active = true end
  end
end
local cands, truncated = {}, false
local function from_index(key)
  local rows = redis.call('ZREVRANGEBYSCORE', key, top, '-inf', 'WITHSCORES', 'LIMIT', 0, n)
  for i = 1, #rows, 2 do cands[#cands + 1] = {rows[i], tonumber(rows[i + 1])} end
  if #rows == 2 * n then truncated = true end
end
if not wanted then
  from_index(tenant == '' and p .. 'jobs' or p .. 'jobs:tenant:' .. tenant)
else
  for s in pairs(wanted) do
    if TERMINAL[s] then
      from_index(tenant == '' and p .. 'jobs:state:' .. s or p .. 'jobs:tenant:' .. tenant .. ':state:' .. s)
    end
  end
  if any_active then
    for _, id in ipairs(redis.call('SMEMBERS', p .. 'jobs:active')) do
      local f = redis.call('HMGET', p .. 'job:' .. id, 'state', 'seq', 'tenant')
      if f[1] and wanted[f[1]] and f[2] and (tenant == '' or f[3] == tenant) then
        local seq = tonumber(f[2])
        if seq < below then cands[#cands + 1] = {id, seq} end
      end
    end
  end
end
table.sort(cands, function(a, b) return a[2] > b[2] end)
local out, got, checked, last, seen = {}, 0, 0, nil, {}
for _, c in ipairs(cands) do
  if got == want or checked == n then break end
  checked = checked + 1
  last = c[2]
  if not seen[c[1]] then
    seen[c[1]] = true
    local f = redis.call('HMGET', p .. 'job:' .. c[1], 'data', 'state', 'tenant')
    if f[1] and (not wanted or wanted[f[2]]) and (tenant == '' or f[3] == tenant) then
      out[#out + 1] = string.format('%d', c[2])
      out[#out + 1] = f[1]
      got = got + 1
    end
  end
end
local more = 0
if checked < #cands or truncated then more = 1 end
return {'ok', last and string.format('%d', last) or '', more, out}
"""

# ARGV[1] = key prefix, ARGV[2] = cutoff (unix s), ARGV[3] = terminal jobs to keep at most, ARGV[4] = limit.
# One bounded step of job retention (StoreBase.sweep_finished_jobs), atomic:
# - a namespace whose records predate the job indexes (no ``jobs:indexed``) is backfilled first, ``limit``
#   records per call, newest to oldest (cursor ``jobs:backfill``): each record gets seq/tenant/request_id and
#   its index entries; the last step sets ``jobs:indexed``. Returns {0, indexed, more}.
# - otherwise the oldest-finished entries of ``jobs:finished`` are taken while they finished before the
#   cutoff or are beyond the newest ``keep`` (both criteria select a prefix of that order), ``limit`` at most;
#   each one still terminal is deleted: its record, every index entry, and its request id mapping when that
#   still names it. One back in a non-terminal state only loses its stale ``jobs:finished`` entry: an active
#   job is never deleted. Returns {deleted, 0, more}.
# Deleting needs ZRANGE, ZCARD and ZREM (elastico.redis_acl); the first write is a ZREM, so a user without
# them is refused before anything changed.
SWEEP = _TERMINAL + r"""
local p = ARGV[1]
local limit = tonumber(ARGV[4])
if not redis.call('GET', p .. 'jobs:indexed') then
  if redis.call('EXISTS', p .. 'jobs:seq') == 0 then
    redis.call('SET', p .. 'jobs:indexed', '1')
    return {0, 0, 0}
  end
  local cursor = redis.call('GET', p .. 'jobs:backfill')
  local rows = redis.call('ZREVRANGEBYSCORE', p .. 'jobs', cursor and '(' .. cursor or '+inf', '-inf',
                          'WITHSCORES', 'LIMIT', 0, limit)
  local indexed = 0
  for i = 1, #rows, 2 do
    local id, seq = rows[i], rows[i + 1]
    local k = p .. 'job:' .. id
    local f = redis.call('HMGET', k, 'data', 'state', 'seq')
    if f[1] and not f[3] then
      local job = cjson.decode(f[1])
      local tenant = tostring(job.spec.tenant)
      redis.call('HSET', k, 'seq', seq, 'tenant', tenant, 'request_id', tostring(job.request_id))
      redis.call('ZADD', p .. 'jobs:tenant:' .. tenant, seq, id)
      if TERMINAL[f[2]] then
        redis.call('ZADD', p .. 'jobs:state:' .. f[2], seq, id)
        redis.call('ZADD', p .. 'jobs:tenant:' .. tenant .. ':state:' .. f[2], seq, id)
        redis.call('ZADD', p .. 'jobs:finished', tonumber(job.updated_at_s) or 0, id)
      else
        redis.call('ZADD', p .. 'jobs:tenant:' .. tenant .. ':active', seq, id)
      end
      indexed = indexed + 1
    end
    redis.call('SET', p .. 'jobs:backfill', seq)
  end
  if #rows < 2 * limit then
    redis.call('SET', p .. 'jobs:indexed', '1')
    redis.call('DEL', p .. 'jobs:backfill')
    return {0, indexed, 0}
  end
  return {0, indexed, 1}
end
local cutoff, keep = tonumber(ARGV[2]), tonumber(ARGV[3])
local excess = redis.call('ZCARD', p .. 'jobs:finished') - keep
local rows = redis.call('ZRANGE', p .. 'jobs:finished', 0, limit - 1, 'WITHSCORES')
local deleted, taken = 0, 0
for i = 1, #rows, 2 do
  local id = rows[i]
  if not (taken < excess or tonumber(rows[i + 1]) < cutoff) then break end
  taken = taken + 1
  redis.call('ZREM', p .. 'jobs:finished', id)
  local k = p .. 'job:' .. id
  local f = redis.call('HMGET', k, 'state', 'tenant', 'request_id')
  if not (f[1] and not TERMINAL[f[1]]) then
    redis.call('DEL', k)
    redis.call('ZREM', p .. 'jobs', id)
    for s in pairs(TERMINAL) do redis.call('ZREM', p .. 'jobs:state:' .. s, id) end
    if f[2] then
      redis.call('ZREM', p .. 'jobs:tenant:' .. f[2], id)
      for s in pairs(TERMINAL) do redis.call('ZREM', p .. 'jobs:tenant:' .. f[2] .. ':state:' .. s, id) end
    end
    if f[3] and redis.call('HGET', p .. 'requests', f[3]) == id then redis.call('HDEL', p .. 'requests', f[3]) end
    deleted = deleted + 1
  end
end
local more = 0
if taken == limit then more = 1 end
return {deleted, 0, more}
"""

# ARGV[1] = key prefix, ARGV[2] = keep seconds, ARGV[3] = max reports kept per job, then (job id, window end, JSON)
# triples. Adds each report unless its job already has one with that window end (idempotent retries) or it ended
# more than keep seconds before the job's newest (too old to count); drops the
# job's reports that ended more than keep seconds before its newest, and the oldest beyond the maximum; the key
# expires 2 x keep after its last write (a deleted job's history goes by itself). Returns 1 (added) or 0 per report.
DEMAND_RECORD = r"""
local p, keep, most = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local out = {}
for i = 4, #ARGV, 3 do
  local k = p .. 'demand:' .. ARGV[i]
  local t = ARGV[i + 1]
  local top = redis.call('ZRANGE', k, -1, -1, 'WITHSCORES')
  local newest = tonumber(top[2] or t)
  if redis.call('ZCOUNT', k, t, t) == 0 and tonumber(t) >= newest - keep then
    redis.call('ZADD', k, t, ARGV[i + 2])
    redis.call('ZREMRANGEBYSCORE', k, '-inf', '(' .. tostring(math.max(newest, tonumber(t)) - keep))
    redis.call('ZREMRANGEBYRANK', k, 0, -most - 1)
    redis.call('PEXPIRE', k, math.floor(2000 * keep))
    table.insert(out, 1)
  else
    table.insert(out, 0)
  end
end
return out
"""

# ARGV[1] = key prefix. Every registered node in one step: a flat list of
# (node JSON, 'share_used,mem_used' of each of its GPUs in the JSON's order joined by ';'). A member of ``nodes``
# without a node record is removed (registration writes the record, then adds the member: a member alone was never
# a node): a node agent may add members, so one that added junk costs this script once, not every round.
NODES = r"""
local p = ARGV[1]
local ids = redis.call('SMEMBERS', p .. 'nodes')
table.sort(ids)
local out = {}
for _, id in ipairs(ids) do
  local data = redis.call('GET', p .. 'node:' .. id)
  if not data then
    redis.call('SREM', p .. 'nodes', id)
  else
    local usage = {}
    for i, g in ipairs(cjson.decode(data).gpus) do
      local u = redis.call('HMGET', p .. 'gpu:' .. id .. ':' .. string.format('%d', g.index), 'share_used', 'mem_used')
      usage[i] = (u[1] or '0') .. ',' .. (u[2] or '0')
    end
    table.insert(out, data)
    table.insert(out, table.concat(usage, ';'))
  end
end
return out
"""

# ARGV[1] = key prefix, ARGV[2..] = node ids. Every listed node's actual state in one step: per node,
# {applied generation or false, flat HGETALL of its workloads}.
WORKLOADS = r"""
local p = ARGV[1]
local out = {}
for i = 2, #ARGV do
  local n = ARGV[i]
  out[i - 1] = {redis.call('GET', p .. 'workloads:' .. n .. ':gen'), redis.call('HGETALL', p .. 'workloads:' .. n)}
end
return out
"""

# KEYS[1] = leader key, KEYS[2] = epoch key; ARGV[1] = holder, ARGV[2] = ttl ms.
# Returns the epoch when ``holder`` holds the lease after the call, nil otherwise.
ACQUIRE = r"""
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
if holder then return nil end
local e = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return e
"""

# KEYS[1] = leader key; ARGV[1] = holder. Deletes the lease only if ``holder`` owns it.
RELEASE = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
