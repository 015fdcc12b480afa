"""The host's busy CPU time, all processes together: what the calibration's CPU samples difference.

/proc/stat counts in ticks (USER_HZ, 100 per second here), so a difference over a window is good to
about ±10 ms per core; sums over many windows average that out.
"""

from __future__ import annotations

import os

_BUSY_FIELDS = 8  # user nice system idle iowait irq softirq steal (guest time is already in user)


def busy_cpu_s() -> float:
    """CPU seconds this host's cores have spent busy since boot (all processes), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1 : 1 + _BUSY_FIELDS]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")
