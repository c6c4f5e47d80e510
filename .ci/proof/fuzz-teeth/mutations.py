"""Small plausible bugs planted one at a time in the ordering code, to score the API fuzzer (issue #27 item 6).

Each mutation replaces one exact piece of library source (it must occur exactly once) with a
buggy variant.  ``run.sh`` applies each in a scratch worktree, runs the fuzzer on CI's seeds
and records whether the fuzzer killed it (a failing run) or it survived.

    python .ci/proof/fuzz-teeth/mutations.py list
    python .ci/proof/fuzz-teeth/mutations.py apply NAME [ROOT]    # edits ROOT's files in place
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple


class Mutation(NamedTuple):
    name: str
    path: str
    old: str
    new: str
    bug: str
    #: More edits of the same bug, ``(path, old, new)`` each (a revert that touched several places).
    more: tuple[tuple[str, str, str], ...] = ()


T = "umem_numba/_memory/_tracker.py"
L = "umem_numba/_launch/_coherent.py"
W = "umem_numba/_launch/_write_inference.py"
P = "umem_numba/_memory/_pool.py"
C = "umem_numba/_arrays/_copy.py"
H = "umem_numba/_hints/_prefetch.py"
E = "umem_numba/_arrays/_export.py"
PL = "umem_numba/_memory/_plain_launch.py"

MUTATIONS = [
    Mutation(
        "tracker-write-after-read",
        T,
        "            if write:\n                covered = (*writes.values(), *reads.values())",
        "            if write:\n                covered = tuple(writes.values())",
        "a write waits for other streams' writes but not for their reads (write-after-read)",
    ),
    Mutation(
        "tracker-read-supersedes-other-streams",
        T,
        "                    for old in covered:\n                        if old.key == key:\n",
        "                    for old in list(self.reads.values()):\n                        if True:\n",
        "a read drops every earlier read from the record, other streams' too (a later write stops waiting for them)",
    ),
    Mutation(
        "tracker-settle-first-event-only",
        T,
        "        busy = [e for e in events if not e.done()]",
        "        busy = [e for e in events[:1] if not e.done()]",
        "host access waits for the first pending event only",
    ),
    Mutation(
        "tracker-host-fast-path-ignores-reads",
        T,
        "            not self.writes\n            and not self.reads\n",
        "            not self.writes\n",
        "host access skips the wait when only reads are pending (a host write lands under a device read)",
    ),
    Mutation(
        "tracker-escaped-not-settled-for-device-work",
        T,
        "        if self.unknown_devices or self.escaped:\n",
        "        if self.unknown_devices:\n",
        "toolkit device work on an escaped buffer does not wait for the other library's work",
    ),
    Mutation(
        "tracker-recycle-escaped",
        T,
        "        if self.unknown_devices or self.escaped or self.holds or self.inflight:\n            return False",
        "        if self.unknown_devices or self.holds or self.inflight:\n            return False",
        "a pool keeps the memory of an escaped buffer on its free list (another library may still use it)",
    ),
    Mutation(
        "deviceuse-no-stream-wait",
        T,
        '            for event in waits.values():\n                _driver.call("cuStreamWaitEvent", self.stream, event.handle, 0, detail=self.what)',
        "            for event in list(waits.values())[:0]:\n                pass",
        "copies, prefetches and lends are not ordered after conflicting work on other streams",
    ),
    Mutation(
        "deviceuse-merge-drops-write",
        T,
        "            merged[id(tracker)] = (tracker, write or (old is not None and old[1]))",
        "            merged[id(tracker)] = (tracker, write and (old is None or old[1]))",
        "two uses of one allocation by one operation merge to a read unless both write (a copy within one "
        "allocation is tracked as a read)",
    ),
    Mutation(
        "launch-waits-overwrite",
        L,
        "                if wait:\n                    waits += wait",
        "                if wait:\n                    waits = list(wait)",
        "a launch with several buffer arguments waits only for the last argument's conflicts",
    ),
    Mutation(
        "launch-unanalysable-source-read-only",
        W,
        "    except Exception:  # no source (exec'd, interactive), none we can parse or match, or too deep\n        return None",
        "    except Exception:  # no source (exec'd, interactive), none we can parse or match, or too deep\n        return ()",
        "a kernel whose source cannot be analysed is treated as read-only",
    ),
    Mutation(
        "launch-event-on-legacy-stream",
        L,
        "            recorded = _events.record(handle, _driver.current_device() if device is None else device, key)",
        "            recorded = _events.record(0, _driver.current_device() if device is None else device, key)",
        "a launch records its event on the legacy stream (which does not wait for non-blocking streams)",
    ),
    Mutation(
        "pool-allocation-records-no-event",
        P,
        "            tracker.add(handle, _events.record(handle, dev))  # the allocation is the first write",
        "            pass",
        "a pool allocation records no event (host access and other streams do not wait for it)",
    ),
    Mutation(
        "pool-ordering-cache-never-invalidated",
        P,
        "if memory.ordered_on != key or tracker.recorded_since(memory.ordered_mark):",
        "if memory.ordered_on != key:",
        "a reused block's per-stream ordering cache ignores events filed since",
    ),
    Mutation(
        "pool-reuse-not-ordered",
        P,
        "        others = [e for e in events if e.key != key or e.device_id != dev]",
        "        others: list = []",
        "a block taken from a free list on another stream does not wait for the old buffer's work",
    ),
    Mutation(
        "copy-to-page-locked-numpy-returns-early",
        C,
        "            _dma(_host_side(out), src, handle, what, sync=True)",
        "            _dma(_host_side(out), src, handle, what, sync=False)",
        "a DMA copy into page-locked numpy memory returns before the copy",
    ),
    Mutation(
        "staging-refilled-under-the-copy-engine",
        C,
        '        stage.tracker.settle(what, "sync")',
        '        stage.tracker.settle(what, "off")',
        "staging slots are refilled without waiting for the DMA that last used them",
    ),
    # Two mutations of an earlier score, "prefetch-not-ordered" (a prefetch neither ordered after writes
    # nor recorded) and "discard-tracked-as-read", were found equivalent (README.md): no program can
    # tell them from the tree by a value, so they were replaced by the two below.
    Mutation(
        "discard-not-recorded",
        H,
        "    return [(s.tracker, True) for s in spans if s.tracker is not None]",
        "    return []",
        "a discard is neither ordered after the buffer's work nor recorded (a later writer on another stream "
        "may run before it)",
    ),
    Mutation(
        "discard-does-not-settle",
        H,
        "    for span in spans:\n        if span.tracker is not None:\n            span.tracker.wait_all(what)\n",
        "    for span in spans:\n        if False:\n            span.tracker.wait_all(what)\n",
        "a discard is issued with writers of other streams still pending (ordered only on the device, which "
        "a GPU's discard ignores)",
    ),
    Mutation(
        "lend-records-on-entry",
        E,
        "            try:\n                yield view\n            finally:\n                tracker.lend_left(lender)",
        "            tracker.lend_left(lender)\n        try:\n            if True:\n                yield view\n        finally:\n            if True:",
        "a lend records its event when the block is entered, not when it ends",
    ),
    Mutation(
        "dlpack-none-not-ordered",
        E,
        "    if stream is None:\n        return _CAI_LEGACY_STREAM",
        "    if stream is None:\n        return None",
        "__dlpack__(stream=None) does not order the legacy stream",
    ),
    Mutation(
        "vmm-shrink-without-settling",
        "umem_numba/_vmm/_buffer.py",
        '            alloc.tracker.settle("shrinking a VMMBuffer", alloc.tracker.effective_policy(), always_wait=True)',
        "            pass",
        "a VMM shrink unmaps without waiting for device work",
    ),
    Mutation(
        "release-without-waiting",
        "umem_numba/_memory/_lifetime.py",
        "        if not (settled or memory.stream_ordered):\n            tracker.wait_all(",
        "        if False:\n            tracker.wait_all(",
        "a closed buffer's memory is freed without waiting for its device work",
    ),
    # The fixes of issue #27 whose commits no longer revert cleanly (later commits touched the same
    # lines), reverted by hand: the line that makes each fix.
    Mutation(
        "revert-item4-host-access-inside-own-lend",
        T,
        "        if lenders and threading.get_ident() in lenders:\n            raise CoherenceError(",
        "        if False:\n            raise CoherenceError(",
        "issue #27 item 4 reverted (afcc62a): host access inside its own lend block waits for itself",
    ),
    Mutation(
        "revert-item5-discard-capture-check",
        H,
        "    refuse_capture(handle, what)  # before cuStreamGetDevice, which a capture forbids (and which invalidates it)",
        "    pass",
        "issue #27 item 5 reverted (be8ce07): a discard asks the stream's device before its capture check",
    ),
    Mutation(
        "revert-item6-pool-capture-check",
        P,
        "        try:\n            refuse_capture(handle, what)\n        except CudaError:",
        "        try:\n            pass\n        except CudaError:",
        "issue #27 item 6 reverted (46f94ea, 164cdbf): pool buffers do not refuse a capturing stream",
    ),
    Mutation(
        "revert-item7-lent-view-legacy-stream",
        E,
        "        return buf._interface(self._alloc, self._stream or _CAI_LEGACY_STREAM)",
        "        return buf._interface(self._alloc, self._stream or None)",
        "issue #27 item 7 reverted (7b48735): a view lent on the legacy stream names stream None",
    ),
    Mutation(
        "revert-item8-dlpack-stream-zero",
        E,
        "    if value == 0:\n",
        "    if False:\n",
        "issue #27 item 8 reverted in part (d299c65): __dlpack__(stream=0) is accepted",
    ),
    Mutation(
        "revert-item9-zero-size-prefetch",
        "umem_numba/_hints/_managed_span.py",
        "    if whole_may_be_empty and start is None and stop is None and size == 0:",
        "    if False:",
        "issue #27 item 9 reverted (087fc51): prefetch / discard of a zero-size buffer raise ValueError",
    ),
    Mutation(
        "revert-pool-destroyed-with-last-allocation",
        P,
        "            now = self._outstanding == 0 and not self._destroyed\n",
        "            now = not self._destroyed\n",
        "fuzzer-found on a GPU (3d3b7b5, 89a1596) reverted: a closed or collected pool destroys the driver "
        "pool while allocations of it are outstanding (their frees then crashed an H100's and an H200's driver)",
    ),
    Mutation(
        "pool-allocation-not-counted",
        P,
        "        ptr = int(ptr) if err == 0 else self._retry(err, nbytes, handle)\n        self._driver_pool.allocated()\n",
        "        ptr = int(ptr) if err == 0 else self._retry(err, nbytes, handle)\n",
        "a driver allocation the pool does not count (89a1596's count): the pool is destroyed at close "
        "under the allocations it missed",
    ),
    Mutation(
        "plain-launch-no-waits",
        T,
        "            waits = [e for e in covered if e.key != key] if covered else _NO_WAITS\n            if mark is not None:",
        "            waits = _NO_WAITS if mark is not None else [e for e in covered if e.key != key]\n            if mark is not None:",
        "a plain numba launch (tracked on its stream since 4a6ce29) does not wait for conflicting work on "
        "other streams",
    ),
    Mutation(
        "plain-launch-eager-no-waits",
        T,
        "                return waits, covered, None\n            alone = not self.unknown_devices\n",
        "                return waits, covered, None\n            waits = _NO_WAITS\n            alone = not self.unknown_devices\n",
        "a plain launch on a stream that gets one event per launch (the per-thread stream, a foreign "
        "stream) does not wait for conflicting work on other streams",
    ),
    Mutation(
        "plain-mark-fast-path-ignores-escape",
        T,
        "                and not self.escaped\n                and not self.inflight\n                and not self.migrate\n",
        "                and not self.inflight\n                and not self.migrate\n",
        "a plain launch under its stream's mark files nothing although the buffer escaped to another "
        "library (#28 item 4's fast path): that library's work is not settled first",
    ),
    Mutation(
        "plain-mark-recorded-early-loses-kernel",
        "umem_numba/_memory/_plain_launch.py",
        "            if mark.event is None:\n                return",
        "            if True:\n                return",
        "a stream mark recorded while its own launch registered (settling an escaped argument) is taken "
        "to cover the kernel queued after it",
    ),
    Mutation(
        "graph-launch-not-ordered",
        "umem_numba/_launch/_graphs.py",
        'DeviceUse(self._uses, handle, "a graph launch", self._epochs)',
        "contextlib.nullcontext()",
        "a launch of a captured graph (#29) is neither ordered after conflicting work on other streams nor "
        "recorded: host access does not wait for it",
    ),
    Mutation(
        "graph-launch-ignores-epochs",
        "umem_numba/_launch/_graphs.py",
        'DeviceUse(self._uses, handle, "a graph launch", self._epochs)',
        'DeviceUse(self._uses, handle, "a graph launch")',
        "a graph launched after one of its pool buffers was closed writes the next buffer over that memory",
    ),
    Mutation(
        "plain-launch-clears-others-unknown-mark",
        T,
        "            if mark is not None and mark == self._unknown_gen:\n",
        "            if True:\n",
        "a plain launch's record clears every unknown mark, not only its own (work on an unknown stream "
        "another launch or library left is no longer waited for)",
    ),
    Mutation(
        "cache-close-does-not-wait",
        "umem_numba/_memory/_cache.py",
        "    stream_ordered = False\n",
        "    stream_ordered = True\n",
        "the allocation cache (#28 item 1) takes a closed buffer's allocation without waiting for its device "
        "work: the next buffer of that size is written by the old buffer's late kernels",
    ),
    Mutation(
        "cache-keeps-advised-memory",
        "umem_numba/_memory/_cache.py",
        "        if _enabled and not self.advised and not tracker.escaped:\n",
        "        if _enabled and not tracker.escaped:\n",
        "the allocation cache hands memory that took advice to the next buffer (it inherits the advice)",
    ),
    Mutation(
        "revert-registration-epoch",
        T,
        "            if epoch is not None and epoch != self.epoch:\n",
        "            if False:\n",
        "7ade936 reverted: work that took a pool buffer's address before close() on another thread registers "
        "under the next buffer over the memory, and writes it",
    ),
    # The reverts of issue #19's fixes kept in .ci/proof/*.patch (written for c16682b), re-expressed on
    # today's code, every hunk of each.
    Mutation(
        "proof-item1-plugin-free",
        "umem_numba/_interop/_emm.py",
        "        pool.free(ptr, unordered=True)  # numba's kernels may still use it on any stream",
        "        pool.free(ptr, 0)",
        ".ci/proof/item1-plugin-free.patch: the memory-manager plugin frees ordered on the legacy stream only",
    ),
    Mutation(
        "proof-item1-pool-unordered",
        P,
        "        if unordered:\n            entry = self._raw_sizes.pop(ptr, None)",
        "        if unordered:\n            stream = 0\n        if False:\n            entry = self._raw_sizes.pop(ptr, None)",
        ".ci/proof/item1-pool-unordered.patch: an unordered free goes on the legacy stream's free list",
    ),
    Mutation(
        "proof-item2-staging-policy",
        C,
        '        tracker.policy = "sync"\n',
        "",
        ".ci/proof/item2-staging-policy.patch: the staging area follows the user's coherence policy",
        more=((C, '        stage.tracker.settle(what, "sync")', "        stage.tracker.before_host_access(what)"),),
    ),
    Mutation(
        "proof-item3-element-store",
        W,
        "            self._write(self._refs(target.value))  # a store through what it refers to",
        "            if isinstance(target.value, ast.Name):\n                self._write(self._refs(target.value))",
        ".ci/proof/item3-element-store.patch: only p[...] = v is a write (p[i][j] = v is read-only again)",
    ),
    Mutation(
        "proof-item5-reuse-ordered-by-handle",
        P,
        "        others = [e for e in events if e.key != key or e.device_id != dev]",
        "        others = [e for e in events if e.stream != stream or e.device_id != dev]",
        ".ci/proof/item5-stream-handles.patch: a reused block's events are compared by stream handle, not id, "
        "and the handles 1 and 2 are their own key",
        more=(
            (
                P,
                "        if handle == 0:\n            key = self._legacy_key\n            if key is None:\n"
                "                with _driver.device_context(self.device_id):",
                "        if handle < 3:\n            return handle\n"
                "        if handle == 0:\n            key = self._legacy_key\n            if key is None:\n"
                "                with _driver.device_context(self.device_id):",
            ),
        ),
    ),
    Mutation(
        "proof-item6-driver-memory-source",
        C,
        "        known = _driver_memory(src)",
        "        known = False",
        ".ci/proof/item6-driver-memory-source.patch: copy_from_host does not wait for a managed or pinned "
        "source (which skips the staged path)",
        more=(
            (
                C,
                "        elif copiers is not None:\n            _staged(dst, src, handle, what, staging, copiers, to_host=False)",
                "        elif copiers is not None and not _driver_memory(src):\n"
                "            _staged(dst, src, handle, what, staging, copiers, to_host=False)",
            ),
        ),
    ),
    Mutation(
        "proof-item7-unseen-work-not-held",
        P,
        "        if pool is not None and not pool._closed and (tracker.unknown_devices or tracker.escaped):",
        "        if False:",
        ".ci/proof/item7-unseen-work.patch: pool memory that work umem_numba could not see used is neither "
        "held nor freed after a synchronise",
        more=((P, "            if unknown or escaped:\n                synchronize_for_reuse(", "            if False:\n                synchronize_for_reuse("),),
    ),
    # Session 38 (#28): the fast paths of default allocations, the host-read prefetch after a wait.
    Mutation(
        "idle-close-ignores-pending-writes",
        T,
        "                and not self.writes\n                and not self.reads\n                and not self.unknown_devices\n                and not self.escaped\n                and not self.inflight\n                and not self.holds\n",
        "                and not self.reads\n                and not self.unknown_devices\n                and not self.escaped\n                and not self.inflight\n                and not self.holds\n",
        "a buffer whose device writes are still on record takes the idle close: closed and cached (or "
        "freed) with no wait, under its late kernels",
    ),
    Mutation(
        "cache-reopens-record-without-epoch",
        "umem_numba/_memory/_cache.py",
        "        if tracker is None or tracker.graphs or tracker.capturing or not tracker.recycle():\n            return None\n",
        "        if tracker is None or tracker.graphs or tracker.capturing:\n            return None\n        tracker._blocked = None\n",
        "cached memory reopens the closed buffer's record without a new epoch: a launch that took the closed "
        "buffer's address registers under the next buffer and writes it",
    ),
    Mutation(
        "legacy-reuse-skips-capture-check",
        P,
        "                    if not checked:\n                        try:\n                            self._refuse_capture(handle, refusal)\n",
        "                    if False:\n                        try:\n                            self._refuse_capture(handle, refusal)\n",
        "a free-list block reused on the legacy stream that needs ordering waits on the stream without the "
        "capture check: inside another stream's capture the wait invalidates it",
    ),
    Mutation(
        "host-read-forgets-device-write",
        "umem_numba/_arrays/_buffer.py",
        "        if self._migrates_on_launch and (tracker.writes or tracker.device_wrote):\n",
        "        if self._migrates_on_launch and tracker.writes:\n",
        "a host read after the host waited for the device's write (its events settled) faults every page in "
        "instead of a prefetch (a hint bug: values stay right)",
    ),
    Mutation(
        "forall-untracked",
        L,
        "        entry[1]._dispatch(args, type_ids, values, uses, epochs, device)\n",
        "        entry[1]._configured(*args)\n",
        "a forall of a um.jit kernel with buffer arguments launches through numba untracked once its "
        "configured launch is kept (the next host access or launch on another stream does not wait)",
    ),
    Mutation(
        "plain-launch-on-forked-stream-not-refused",
        PL,
        "        if launch._check_capture():\n            raise CoherenceError(_capture_refusal(launch.handle))",
        "        if launch._check_capture():\n            tracker.on_device_export(False)\n            return",
        "a786983 reverted: a plain launch of a buffer on a stream forked into um.capture is taken in as an "
        "unknown-stream use (every later replay of the graph writes it untracked)",
    ),
    # Fix commits of fixes.txt that no longer revert cleanly (session 45), re-expressed on today's code.
    Mutation(
        "revert-lend-files-consumer-streams",
        T,
        "        if not events and unseen_device is None:\n            return\n",
        "        if True:\n            return\n",
        "306f581 reverted: a lend files none of the work its consumers were told to do on their streams "
        "(later work and host access do not wait for it)",
    ),
    Mutation(
        "revert-escaped-device-work-settles",
        T,
        "        if self.unknown_devices or self.escaped:\n            # Work on an unknown stream",
        "        if self.unknown_devices:\n            # Work on an unknown stream",
        "20c5fa9 reverted: toolkit device work on an escaped buffer does not settle another library's work first",
    ),
    Mutation(
        "revert-driver-free-beside-capture",
        "umem_numba/_memory/_lifetime.py",
        "        with _driver.capture_safe():  # a free beside a user's graph capture leaves it intact\n",
        "        if True:\n",
        "8183b13 reverted (its free half): a driver free beside a user's global capture invalidates the capture",
    ),
]


def apply(name: str, root: Path) -> None:
    (m,) = [m for m in MUTATIONS if m.name == name]
    for rel, old, new in ((m.path, m.old, m.new), *m.more):
        path = root / rel
        text = path.read_text()
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"{name}: the original text occurs {count} times in {rel} (expected once)")
        path.write_text(text.replace(old, new))


if __name__ == "__main__":
    if sys.argv[1:2] == ["list"]:
        for m in MUTATIONS:
            print(f"{m.name}\t{m.path}\t{m.bug}")
    elif sys.argv[1:2] == ["apply"]:
        apply(sys.argv[2], Path(sys.argv[3] if len(sys.argv) > 3 else "."))
    else:
        raise SystemExit(__doc__)
