"""A modelled link for measuring overlap on one machine: each collective completes no earlier than a link of a given
latency and bandwidth would deliver it.

On one machine, gloo's collectives are memory copies that finish in microseconds, so hiding them behind computation
cannot be measured. A :class:`DelayedLink` given to a dispatcher (``link=``) holds every collective it issues, forward
and backward, until ``latency_s + bytes / bandwidth_bytes_per_s`` after the link was free to start it: the link
carries one collective at a time, in the order they were issued (a NIC's queue), and a collective that is waited on
right away costs its whole transfer, while one waited on later costs only what is left of it. The bytes are those this
rank sends to other ranks (what leaves the device). ``busy_s`` sums the modelled transfer times, the communication
time ``T_comm`` an overlap's hidden fraction ``(T_none - T_overlap) / T_comm`` is measured against, and ``waited_s``
the host's time blocked waiting for the collectives: the communication the computation did not hide. With its
defaults (no latency, unbounded bandwidth) a link delays nothing and only counts, which is how a trainer on gloo
measures the exposed expert-parallel communication of a real step.

The delay is a sleep on the host at ``wait``; the real collective runs as it would. On a GPU it stalls the host, not
the stream: it models a link on CPU runs only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class DelayedLink:
    """A link of ``latency_s`` per collective and ``bandwidth_bytes_per_s`` (module docstring)."""

    latency_s: float = 0.0
    bandwidth_bytes_per_s: float = float("inf")
    busy_s: float = 0.0  # modelled transfer time of every collective issued so far
    bytes_sent: int = 0
    collectives: int = 0
    waited_s: float = 0.0  # the host's time blocked waiting for the collectives (exposed communication)
    _free_at: float = field(default=0.0, repr=False)  # perf_counter time the link finishes its queue

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency_s={self.latency_s}: must be at least 0")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s={self.bandwidth_bytes_per_s}: must be positive")

    def transfer_s(self, nbytes: int) -> float:
        """The modelled time of a collective that sends ``nbytes`` to other ranks."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def issue(self, nbytes: int) -> float:
        """Queue a collective of ``nbytes`` on the link; returns the ``time.perf_counter()`` it completes at."""
        duration = self.transfer_s(nbytes)
        self._free_at = max(time.perf_counter(), self._free_at) + duration
        self.busy_s += duration
        self.bytes_sent += nbytes
        self.collectives += 1
        return self._free_at

    @staticmethod
    def wait_until(done_at: float) -> None:
        """Block until the modelled completion ``done_at`` (a value :meth:`issue` returned)."""
        left = done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def reset(self) -> None:
        """Forget the counters and the queue (between measured steps)."""
        self.busy_s, self.bytes_sent, self.collectives, self._free_at, self.waited_s = 0.0, 0, 0, 0.0, 0.0
