"""Lua scripts run atomically inside Redis. Keys are built from the prefix passed as ARGV[1]
(see ``elastico.state.keys``: all keys share one hash tag, so one slot)."""

# The body of one transaction (see elastico.state.store.Transaction), shared by APPLY and APPLY_EACH.
# Records (job JSON, placement JSON) travel as their own ARGV entries, named by index (``data_arg``) in
# the transaction JSON: no JSON-in-JSON escaping to encode in the client and decode in the script.
# Every check runs before the first write, so a transaction that fails writes nothing. A job write with
# ``index_seq`` is added to the job index scored by the next submission sequence number (INCR here, after
# the checks: a rejected submission consumes no number).
_APPLY_ONE = r"""
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
  for _, w in ipairs(tx.jobs) do
    local v = tonumber(redis.call('HGET', p .. 'job:' .. w.job_id, 'version') or '0')
    if v ~= w.expected_version then return {'version', w.job_id, tostring(v), tostring(w.expected_version)} end
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
  for _, w in ipairs(tx.jobs) do
    redis.call('HSET', p .. 'job:' .. w.job_id, 'data', ARGV[w.data_arg], 'version', string.format('%d', w.new_version), 'state', w.state)
    if w.index_score ~= cjson.null then
      redis.call('ZADD', p .. 'jobs', string.format('%d', w.index_score), w.job_id)
    elseif w.index_seq then
      redis.call('ZADD', p .. 'jobs', string.format('%d', redis.call('INCR', p .. 'jobs:seq')), w.job_id)
    end
    if w.state == 'succeeded' or w.state == 'failed' or w.state == 'cancelled' then
      redis.call('SREM', p .. 'jobs:active', w.job_id)
    else
      redis.call('SADD', p .. 'jobs:active', w.job_id)
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

# ARGV[1] = key prefix. Every registered node in one step: a flat list of
# (node JSON, 'share_used,mem_used' of each of its GPUs in the JSON's order joined by ';').
NODES = r"""
local p = ARGV[1]
local ids = redis.call('SMEMBERS', p .. 'nodes')
table.sort(ids)
local out = {}
for _, id in ipairs(ids) do
  local data = redis.call('GET', p .. 'node:' .. id)
  if data then
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
