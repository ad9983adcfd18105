"""The Python runtime of a long-lived envfleet process (the control plane, a rollout worker).

The cyclic garbage collector's default thresholds (a young collection every 700 net allocations of tracked objects)
suit short scripts. A process that makes tasks, futures and messages for every rollout crosses 700 several times
a rollout: on the fleet bench the collections' walks took a quarter of the control plane's CPU, and a worker's CPU
per rollout fell by a quarter once tuned. `tune_gc` freezes what start-up made (modules, config, servers: never
garbage, so never walked again) and collects the young generation every 50,000 allocations instead; what is garbage
is still collected, a little later. Measured side by side with bench/fleet_bench.py (README, "Many cores and many
hosts").
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (50_000, 20, 20)


def tune_gc() -> None:
    """Freeze the objects made so far and raise the collector's thresholds; call once start-up is done."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
