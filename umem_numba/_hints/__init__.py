"""Advice and prefetch on managed memory: validated managed byte ranges, advice, prefetch and discard.

``_managed_span`` (the validated byte range they act on), ``_prefetch`` (prefetch, discard, plans) and
``_advice`` (advice, policies, read-back).
"""
