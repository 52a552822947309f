"""The records of one atomic store change (:class:`Transaction`): job writes, GPU capacity deltas, desired-state
operations and events, as ``StoreBase`` builds them and each backend's ``_apply`` executes them all or nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastico.domain import Job


@dataclass(frozen=True)
class JobWrite:
    """Replace a job record if its version is still ``expected_version`` (0 = must not exist yet)."""

    job_id: str
    expected_version: int
    new_version: int
    state: str
    data: str  # JSON of the new Job
    index_score: int | None = None  # add to the job index with this score (creation only)
    index_seq: bool = False  # add to the job index scored by the next submission sequence number (creation only)
    tenant: str = ""  # the job's tenant (creation only: indexed by it)
    request_id: str = ""  # the job's request id (creation only: the retention sweep drops its mapping with it)
    time_s: float = 0.0  # the job's updated_at_s (entering a terminal state: its finish time, for retention)
    # creation only: refused (ResourceExhausted, nothing written) when the tenant already has this many jobs in a
    # non-terminal state; 0 = no limit
    live_limit: int = 0


@dataclass(frozen=True)
class GpuDelta:
    """Add (or with negative values, release) a compute share and memory on one GPU."""

    node_id: str
    gpu_index: int
    share_units: int  # 1/100 percent
    mem_mib: int


@dataclass(frozen=True)
class DesiredOp:
    """Set (``data`` = Placement JSON) or delete (``data`` = None) one job in a node's desired state."""

    node_id: str
    job_id: str
    data: str | None


@dataclass(frozen=True)
class EventRecord:
    """An event to append to the job event stream."""

    job_id: str
    state: str
    reason: str
    message: str
    version: int
    time_s: float


@dataclass
class Transaction:
    """One atomic change. ``epoch`` not None = fenced: rejected unless it equals the current epoch."""

    epoch: int | None = None
    claim_request: tuple[str, str] | None = None  # (request_id, job_id): fails if request_id is taken
    jobs: list[JobWrite] = field(default_factory=list)
    gpus: list[GpuDelta] = field(default_factory=list)
    desired: list[DesiredOp] = field(default_factory=list)
    events: list[EventRecord] = field(default_factory=list)


@dataclass(frozen=True)
class PreparedUpdates:
    """``update_jobs`` changes encoded ahead of time (``Store.prepare_updates``), applied by ``apply_updates``.

    Lets a caller do the encoding while it waits for something else (a round: while the policy decides).
    """

    items: tuple[tuple[Transaction, Job], ...]  # (its transaction, the job it stores) per change

    def only(self, job_ids: set[str]) -> PreparedUpdates:
        """The changes of ``job_ids`` only (in their original order)."""
        return PreparedUpdates(tuple(it for it in self.items if it[1].job_id in job_ids))


@dataclass(frozen=True)
class SweepResult:
    """What one ``sweep_finished_jobs`` step did."""

    deleted: int = 0  # finished jobs deleted (record, index entries, request id mapping)
    indexed: int = 0  # records of a namespace older than the job indexes indexed by the backfill
    more: bool = False  # the step stopped at its limit: more work is due now


class DuplicateRequest(Exception):
    """Internal: the transaction's request id already maps to ``job_id``."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id
