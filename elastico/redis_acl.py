"""Redis ACL users per ElastiCo role, for one key namespace (pure: rule strings and ACL-file lines, no I/O).

Each service gets its own user with only the commands and keys it uses (``make up`` wires them): a stolen
node password cannot rewrite desired state, jobs or another node's GPUs. Read-only keys (``%R~``) and
selectors (``(...)``) need Redis >= 7; ``redis7=False`` gives Redis 6 rules, coarser for node users (their
read keys and the ``nodes`` set become writable too). Lua scripts are no way around this: Redis checks
every ``redis.call`` inside a script against the caller's ACL, whether or not the key was in KEYS.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping

from elastico.state.keys import Keys

# every user: the connection basics redis-py sends (PING health checks, SELECT for a non-zero db, MULTI/EXEC
# pipelines), no pub/sub channels, nothing else unless added
_BASE = "resetkeys resetchannels -@all +ping +select +multi +exec +discard"
ADMIN_RULES = "~* &* +@all"
DEFAULT_USER_LINE = "user default off resetpass ~* &* +@all"
# what RedisStore runs, directly and inside its Lua scripts (elastico/state/redis_store.py, lua.py)
_ALLOCATOR_COMMANDS = ("+evalsha +script|load +get +set +mget +del +exists +incr +pexpire +hget +hset +hsetnx +hdel "
                       "+hmget +hgetall +sadd +srem +smembers +zadd +zrevrangebyscore +zrangebyscore +zrange +zcard +zcount +zrem +zremrangebyscore +zremrangebyrank +xadd +xread +xinfo|stream")
# what the node agent's store calls run: put_node, get_node, get_desired, report_workloads, get_job
_NODE_COMMANDS = "+get +set +del +hget +hset +hsetnx +hmget +hgetall"
_SAFE = re.compile(r"[\w.@-]+")  # no whitespace (ACL file syntax), glob characters or ':' (key patterns)


def new_password() -> str:
    return secrets.token_urlsafe(32)


def _safe(value: str, what: str) -> str:
    if not _SAFE.fullmatch(value):
        raise ValueError(f"{what} {value!r} cannot be used in a Redis ACL rule (letters, digits, '.', '@', '_', '-' only)")
    return value


def _keys(namespace: str) -> Keys:
    return Keys(_safe(namespace, "namespace"))


def allocator_rules(namespace: str = "elastico") -> str:
    """Every key of the namespace, the commands RedisStore uses; no admin, no KEYS/FLUSH*/CONFIG/ACL."""
    return f"{_BASE} {_ALLOCATOR_COMMANDS} ~{_keys(namespace).prefix}*"


def node_rules(node_id: str, namespace: str = "elastico", *, redis7: bool = True) -> str:
    """Write its own node record, GPUs and actual state; read its desired state and job records; SADD ``nodes``.

    The ``nodes`` set is shared, so a node can add any member (not remove one); GPU hashes cannot be limited
    per field, so a node could write its own GPUs' usage fields; job records are readable in full (the agent
    needs the spec of the jobs it starts).
    """
    k, n = _keys(namespace), _safe(node_id, "node id")
    own = [k.node(n), f"{k.prefix}gpu:{n}:*", k.workloads(n), k.workloads_gen(n)]
    reads = [k.desired(n), k.desired_gen(n), f"{k.prefix}job:*"]
    if not redis7:
        return f"{_BASE} {_NODE_COMMANDS} +sadd " + " ".join(f"~{p}" for p in [*own, *reads, k.nodes])
    return (f"{_BASE} {_NODE_COMMANDS} " + " ".join(f"~{p}" for p in own) + " "
            + " ".join(f"%R~{p}" for p in reads) + f" (+sadd ~{k.nodes})")


def predictor_rules(namespace: str = "elastico", *, redis7: bool = True) -> str:
    """The observation stream (XADD, XRANGE, XLEN) and the id of its last consumed entry (GET, SET)."""
    k = _keys(namespace)
    if not redis7:
        return f"{_BASE} +xadd +xrange +xlen +get +set ~{k.observations} ~{k.observations_consumed}"
    return f"{_BASE} +xadd +xrange +xlen ~{k.observations} (+get +set ~{k.observations_consumed})"


def node_user(node_id: str) -> str:
    """ACL user name of a node agent."""
    return f"node.{node_id}"


def cluster_users(node_ids: list[str], namespace: str = "elastico", *, redis7: bool = True) -> dict[str, tuple[str, str]]:
    """name -> (fresh password, rules) for a whole suite: admin (operators and tests), each service, each node."""
    rules = {"admin": ADMIN_RULES, "allocator": allocator_rules(namespace), "predictor": predictor_rules(namespace, redis7=redis7)}
    rules.update({node_user(n): node_rules(n, namespace, redis7=redis7) for n in node_ids})
    return {name: (new_password(), r) for name, r in rules.items()}


def users_acl_lines(users: Mapping[str, tuple[str, str]]) -> list[str]:
    """ACL-file lines: the ``default`` user off (no login), then ``user <name> on #<sha256 of password> <rules>`` each.

    Only password hashes are written (as ``ACL SAVE`` would): the file alone does not let anyone in.
    """
    # the default user is off (no one logs in as it) but keeps full rights: Redis replays its AOF as that user,
    # and a restricted default user makes the replay refuse every MULTI/EXEC block (redis/redis#14541), losing
    # the data of a restart
    lines = [DEFAULT_USER_LINE]
    for name, (password, rules) in users.items():
        if name == "default":
            raise ValueError("the default user stays off: name the user")
        digest = hashlib.sha256(password.encode()).hexdigest()
        lines.append(f"user {_safe(name, 'user name')} on resetpass #{digest} {rules}")
    return lines
