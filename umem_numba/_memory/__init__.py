"""Memory below the arrays: allocations and their one release path, coherence tracking, events, statistics, pools.

``_stats`` (counters per kind), ``_events`` (pooled CUDA events), ``_tracker`` (coherence per
allocation), ``_lifetime`` (Allocation / Memory / Resource / Transaction), ``_resources`` (each memory
kind as a resource: where it is reachable, how a pool makes it), ``_free_lists`` (a pool's free-list
policy) and ``_pool`` (the stream-ordered pool façade).
"""
