"""The disk tier: experts the placement put beyond `--host-mem` stay in weights.bin on disk.

They are read through the plan's read-only mmap when a token chooses them (the page cache does
the reading, with the kernel's own read-ahead), and after every step their pages are dropped
from the process (madvise DONTNEED), so the resident set stays within the host budget plus the
experts of one step, whatever the model's size.
"""

from __future__ import annotations

import json
import re

from strata_compiler.formats import get_format
from strata_compiler.plan_format import section_name


class DiskTier:
    """A plan's disk-tier experts; with any, it sits on the plan's weights (`plan.weights.disk_tier`),
    where the executors reading those weights find it."""

    def __init__(self, plan) -> None:
        self.container = plan.weights.c
        self.ranges: list[tuple[int, int]] = []
        self.by_weight: dict[str, list[tuple[int, int]]] = {}
        sections: set[str] = set()
        placement = plan.meta["model"].get("placement")
        units = json.loads(placement).get("disk_units", []) if placement else []
        want: dict[int, set[int]] = {}
        for u in units:
            m = re.fullmatch(r"L(\d+)\.e(\d+)", u)
            if m:
                want.setdefault(int(m[1]), set()).add(int(m[2]))
        for w in plan.graph.weights:
            m = re.match(r"L(\d+)\.moe\.", w.name)
            if not m or not w.experts or int(m[1]) not in want:
                continue
            ids = w.expert_ids or tuple(range(w.experts))
            for arr, (dt, shape) in get_format(w.fmt).array_shapes(w.shape, w.group_size or 32).items():
                sections.add(section_name(w.name, arr))
                info = self.container.info(section_name(w.name, arr))
                per = info.length // shape[0]
                for i, e in enumerate(ids):
                    if e in want[int(m[1])]:
                        self.ranges.append((info.offset + i * per, per))
                        self.by_weight.setdefault(w.name, []).append((info.offset + i * per, per))
        self.bytes = sum(n for _, n in self.ranges)
        plan.weights.disk_tier = self if self.ranges else None
        for name in sections:   # checksum the sections now (that reads them), then let their pages go
            info = self.container.info(name)
            self.container.section(name)
            self.container.release(info.offset, info.length)

    def after(self, weight_names) -> None:
        """Called by a MoE kernel when it is done: its disk-tier experts' pages go now, so a
        prefill that touches every expert holds one layer's at a time."""
        for name in weight_names:
            for off, n in self.by_weight.get(name, ()):
                self.container.release(off, n)

    def release(self) -> None:
        for off, n in self.ranges:
            self.container.release(off, n)
