"""Memory below the arrays: allocations and their one release path, coherence tracking, events, statistics, pools.

``_stats`` (counters per kind), ``_events`` (pooled CUDA events), ``_tracker`` (coherence per
allocation), ``_lifetime`` (Allocation / Memory / Resource / Transaction), ``_pool_kinds`` (what each
kind of pool allocates, and where) and ``_pool`` (stream-ordered pools).
"""
