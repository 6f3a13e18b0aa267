"""The named-barrier protocols of a patch and of a landed switch, checked on a model:
every order in which the parties' barrier operations can interleave, on hardware named
barriers' rules. This is a model of the protocols, not of the kernels (Gluon kernels do not run
here): a wrong protocol hangs on the GPU, where a run costs device time.

The protocols:
- `notes/patches/fwd-named-turns.patch` (`hopper.forward.PINGPONG = 2`, not kept): the
  consumer warpgroups take turns through barriers TURN + c, each phase made of 256 threads.
- `hopper.backward.NAMED_HANDOFF` (on since 0d42c3c; first written as
  `notes/patches/bwd-named-handoff.patch`): dQ's buffers go between the 256 compute
  threads and the 128-thread writer through barriers READY + b and FREE + b, 384 threads
  a phase.

The rules (PTX `bar.sync` / `bar.arrive`): a barrier counts the threads that arrive; a
`sync` arrives and waits; the phase completes when the count reaches the barrier's thread
count, which releases every waiter and starts the next phase at zero. The model treats a
warpgroup as one party. Its warps arrive one by one on the GPU, but no phase can take a
warp of the next phase, because a party reaches its next arrival only after a phase that
needs this one to complete. What must hold:
- no deadlock, in any order;
- no phase completed by arrivals alone (its waiter would wait for the next one);
- no phase left open when the program ends (every barrier at zero).

And the forward kernel's Q slots (`hopper.forward.Q_SLOTS`), on mbarriers' parity waits
(`explore_q_slots`): no deadlock, no consumer reading another item's Q, no load over a slot
in use; with the causal claims (`hopper.forward.CAUSAL_CLAIMS`; and every varlen launch
since f3907b0, `DOC_ROWS`, its document beside the index) each item's index goes with its Q
slot and the loader ends the consumers' loop through the next slot: no consumer reads
another item's index, none is left waiting. With `hopper.forward.LATE_Q_FREE`
(f30cbb6) a slot goes back under the next item's first product, its O store in flight
until then: the same, with no load over a store in flight, and two slots needed.

And the Hopper backward's Q/dO slots with and without `hopper.backward.SLOT_BY_DQ`
(`explore_bwd_slots`): with it, the loader takes a slot as free once it has waited for that
step's dQ, with no free barrier: no deadlock, no load over a slot the compute warps still
read, no dQ mixed up.
"""

import functools

import pytest


def explore(programs: dict, threads: dict) -> None:
    """Every interleaving of `programs` (party -> [("sync" | "arrive", barrier, count)]),
    parties of `threads[party]` threads; raises AssertionError on a deadlock, a phase
    without a waiter, a phase overfilled, a count that differs between operations, or a
    barrier left open at the end."""
    parties = sorted(programs)
    counts: dict = {}
    for party in parties:
        for _, bar, count in programs[party]:
            assert counts.setdefault(bar, count) == count, f"barrier {bar}: counts differ"

    @functools.cache
    def step(pcs: tuple, arrived: tuple, waiting: frozenset) -> None:
        # arrived: (barrier, threads so far, whether a sync is among them) for open phases
        runnable = [i for i, p in enumerate(parties)
                    if pcs[i] < len(programs[p]) and p not in waiting]
        if not runnable:  # (a party still waiting at its last sync is not done)
            done = all(pc == len(programs[p]) for p, pc in zip(parties, pcs, strict=True))
            assert done and not waiting, (f"deadlock: {dict(zip(parties, pcs, strict=True))},"
                                          f" {sorted(waiting)} waiting, {arrived}")
            assert not arrived, f"barriers left open at the end: {arrived}"
            return
        for i in runnable:
            party = parties[i]
            kind, bar, count = programs[party][pcs[i]]
            state = dict((b, (n, s)) for b, n, s in arrived)
            n, synced = state.get(bar, (0, False))
            n += threads[party]
            synced = synced or kind == "sync"
            assert n <= count, f"barrier {bar} overfilled by {party}"
            new_pcs = pcs[:i] + (pcs[i] + 1,) + pcs[i + 1:]
            new_waiting = set(waiting)
            if n == count:  # the phase completes: its waiters go on
                assert synced, f"barrier {bar}: a phase completed by arrivals alone"
                state.pop(bar, None)
                new_waiting -= {p for p in waiting if _waits_on(programs, parties, pcs, p)
                                == bar}
            else:
                state[bar] = (n, synced)
                if kind == "sync":
                    new_waiting.add(party)
            step(new_pcs, tuple(sorted((b, m, s) for b, (m, s) in state.items())),
                 frozenset(new_waiting))

    step(tuple(0 for _ in parties), (), frozenset())


def _waits_on(programs, parties, pcs, party):
    """The barrier a waiting party's sync is on (its pc has not moved past the sync)."""
    i = parties.index(party)
    # a waiting party's pc was advanced past its sync when it was executed
    return programs[party][pcs[i] - 1][1]


TURN, READY = 8, 8


def forward_turns(consumers: int, tiles: list[int], final_sync: bool = True,
                  first_arrivals: int = 1) -> dict:
    """The forward patch's turns: the last consumer lets consumer 0 go first; a consumer
    takes a turn for each key tile after an item's first (the same items for all); consumer
    0 closes its barrier's extra phase at the end."""
    programs = {}
    for c in range(consumers):
        ops = [("arrive", TURN, 256)] * first_arrivals if c == consumers - 1 else []
        for n in tiles:
            for _ in range(1, n):
                ops += [("sync", TURN + c, 256), ("arrive", TURN + (c + 1) % consumers, 256)]
        if c == 0 and final_sync:
            ops.append(("sync", TURN, 256))
        programs[f"consumer{c}"] = ops
    return programs


def backward_handoff(steps: int, bufs: int, skip_last_free: bool = True,
                     first_free_all: bool = False) -> dict:
    """The backward patch's dQ hand-over: the writer frees each buffer once for its first
    use, then again after a use only where a later step uses it; a compute step waits for
    its buffer free and arrives at its ready; the writer waits at ready."""
    free = READY + bufs
    writer = [("arrive", free + b, 384) for b in range(bufs) if first_free_all or b < steps]
    compute = []
    for t in range(steps):
        b = t % bufs
        compute += [("sync", free + b, 384), ("arrive", READY + b, 384)]
        writer.append(("sync", READY + b, 384))
        if not skip_last_free or t + bufs < steps:
            writer.append(("arrive", free + b, 384))
    return {"writer": writer, "compute": compute}


@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("tiles", [[], [1], [0, 1], [2], [3, 1, 2], [5], [1, 4, 0, 2]])
def test_the_forward_turns_never_hang_and_end_closed(consumers, tiles):
    explore(forward_turns(consumers, tiles), {f"consumer{c}": 128 for c in range(consumers)})


@pytest.mark.parametrize("bufs", [1, 2])
@pytest.mark.parametrize("steps", [0, 1, 2, 3, 5])
def test_the_backward_handoff_never_hangs_and_ends_closed(bufs, steps):
    explore(backward_handoff(steps, bufs), {"writer": 128, "compute": 256})


def test_the_model_catches_what_the_protocols_guard_against():
    threads2 = {"consumer0": 128, "consumer1": 128}
    # without consumer 0's last wait, its barrier ends with an arrival open
    with pytest.raises(AssertionError, match="left open"):
        explore(forward_turns(2, [3], final_sync=False), threads2)
    # without the arrival that lets consumer 0 go first, both wait for each other
    with pytest.raises(AssertionError, match="deadlock"):
        explore(forward_turns(2, [3], first_arrivals=0), threads2)
    # two first arrivals fill a phase with no one waiting in it
    with pytest.raises(AssertionError, match="arrivals alone"):
        explore(forward_turns(2, [3], first_arrivals=2), threads2)
    threads = {"writer": 128, "compute": 256}
    # the writer freeing a buffer after its last use leaves that phase open
    with pytest.raises(AssertionError, match="left open"):
        explore(backward_handoff(3, 2, skip_last_free=False), threads)
    # freeing both buffers ahead where one step uses one
    with pytest.raises(AssertionError, match="left open"):
        explore(backward_handoff(1, 2, first_free_all=True), threads)


def explore_q_slots(items: int, slots: int, consumers: int, free_parity_flip: bool = True,
                    release_before_store: bool = False, claims: bool = False,
                    end_without_wait: bool = False, late_free: bool = False) -> None:
    """The forward kernel's Q slots (`forward_kernel._loader` and `_consumer`, Q_SLOTS), on
    mbarriers' parity waits, over every interleaving: the loader waits on slot s's free
    barrier at parity ((i // slots) & 1) ^ 1, then loads item i into s (its ready barrier
    completes a phase when the load lands); each consumer waits on s's ready barrier at
    parity (i // slots) & 1, reads Q and stores O through the slot, then arrives on its free
    barrier (CONSUMERS arrivals a phase). A wait at parity p passes while the barrier's
    current phase has the other parity (a fresh barrier's "phase before the first" counts
    as done). Raises AssertionError on a deadlock, a consumer reading a slot that holds
    another item's Q, or a load overwriting a slot a consumer still uses.
    `release_before_store`: the consumers arrive before their store (a bug).

    `claims` (CAUSAL_CLAIMS): the loader writes each item's index into its slot's row before
    the load (`forward_kernel._publish`), and after the last item writes the end (`items`)
    into the next slot once it is free and arrives on its ready barrier with no load; a
    consumer reads the index of each slot it waits for, and leaves on the end. Raises too
    where a consumer reads an index not its item's, or waits for good at the end.
    `end_without_wait`: the loader writes the end without waiting for the slot's free
    barrier (a bug: it may overwrite an index a consumer has not read yet).

    `late_free` (`hopper.forward.LATE_Q_FREE`): a consumer's store of O
    through its slot stays in flight (a TMA store reading the slot's tiles) and the slot is
    released only once the consumer has read its next item's Q (under that item's first
    product), or when it leaves; a load over a slot whose store is in flight is an error
    too. With one slot the next item waits on that very slot: a deadlock."""
    # state: the loader's item, each consumer's (item, stage, the item whose store holds a
    # slot: late_free), each slot's item and its barriers' completed phases and pending
    # arrivals
    def parity_passes(completed: int, parity: int) -> bool:
        return (completed & 1) != parity

    last = items + 1 if claims else items  # (claims: the end goes through a slot too)

    @functools.cache
    def step(loader: int, cons: tuple, held: tuple, ready: tuple, free: tuple,
             free_pending: tuple, landing: tuple, index: tuple) -> None:
        moves = 0
        # the loader: wait free, then issue the load of item `loader` into its slot
        if loader < items:
            s = loader % slots
            parity = ((loader // slots) & 1) ^ (1 if free_parity_flip else 0)
            if parity_passes(free[s], parity) and landing[s] is None:
                for c, (item, stage, pending) in enumerate(cons):
                    using = item < items and item % slots == s and stage in ("read", "store")
                    assert not using, (f"item {loader}'s load overwrites slot {s} while "
                                       f"consumer {c} uses item {item}")
                    assert pending is None or pending % slots != s, (
                        f"item {loader}'s load overwrites slot {s} while consumer {c}'s store "
                        f"of item {pending} reads it")
                moves += 1
                step(loader + 1, cons, held, ready, free, free_pending,
                     landing[:s] + (loader,) + landing[s + 1:],
                     index[:s] + (loader,) + index[s + 1:] if claims else index)
        elif claims and loader == items:  # the end, through the next slot, with no load
            s = items % slots
            parity = ((items // slots) & 1) ^ (1 if free_parity_flip else 0)
            if (end_without_wait or parity_passes(free[s], parity)) and landing[s] is None:
                moves += 1
                step(loader + 1, cons, held, ready[:s] + (ready[s] + 1,) + ready[s + 1:],
                     free, free_pending, landing, index[:s] + (items,) + index[s + 1:])
        # a load in flight lands: the slot holds the item, its ready barrier completes
        for s in range(slots):
            if landing[s] is not None:
                moves += 1
                step(loader, cons, held[:s] + (landing[s],) + held[s + 1:],
                     ready[:s] + (ready[s] + 1,) + ready[s + 1:], free, free_pending,
                     landing[:s] + (None,) + landing[s + 1:], index)
        def release(free, free_pending, s):  # a consumer's arrival on slot s's free barrier
            n = free_pending[s] + 1
            if n == consumers:  # the free barrier's phase completes
                free = free[:s] + (free[s] + 1,) + free[s + 1:]
                n = 0
            return free, free_pending[:s] + (n,) + free_pending[s + 1:]

        for c, (item, stage, pending) in enumerate(cons):
            if item >= last:
                if pending is not None:  # late_free: leaving, the last store's slot back
                    moves += 1
                    step(loader, cons[:c] + ((item, stage, None),) + cons[c + 1:], held, ready,
                         *release(free, free_pending, pending % slots), landing, index)
                continue
            s = item % slots
            after = None
            f, fp = free, free_pending
            if stage == "wait" and parity_passes(ready[s], (item // slots) & 1):
                if claims:
                    assert index[s] == item, (f"consumer {c} waited for item {item} in slot "
                                              f"{s} and read index {index[s]}")
                if item == items:  # (claims: the end)
                    moves += 1
                    step(loader, cons[:c] + ((last, "done", pending),) + cons[c + 1:], held,
                         ready, free, free_pending, landing, index)
                    continue
                assert held[s] == item, (f"consumer {c} reads slot {s} for item {item}, "
                                         f"which holds item {held[s]}")
                after = (item, "read", pending)
            elif stage == "read":
                after = (item, "store", pending)
                if pending is not None:  # late_free: the item before's slot, given back now
                    f, fp = release(free, free_pending, pending % slots)
                    after = (item, "store", None)
                if release_before_store:
                    after = (item, "release-early", None)
            elif stage == "store" and late_free:  # the store stays in flight, the slot held
                after = (item + 1, "wait", item)
            elif stage in ("store", "release-early"):
                f, fp = release(free, free_pending, s)
                after = ((item + 1, "wait", None) if stage == "store"
                         else (item, "late-store", None))
            elif stage == "late-store":
                after = (item + 1, "wait", None)
                if held[s] != item or landing[s] is not None:
                    raise AssertionError(f"consumer {c} stores O of item {item} through "
                                         f"slot {s} after its release: a load may be there")
            if after is not None:
                moves += 1
                step(loader, cons[:c] + (after,) + cons[c + 1:], held, ready, f, fp, landing,
                     index)
        if not moves:
            finished = loader == last and all(i >= last and p is None for i, _, p in cons)
            assert finished, f"deadlock: loader at {loader}, consumers {cons}"

    none = (None,) * slots
    zeros = (0,) * slots
    step(0, ((0, "wait", None),) * consumers, none, zeros, zeros, zeros, none, none)


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("items", [0, 1, 2, 5])
def test_q_slots_never_hang_and_never_mix_items(items, slots, consumers):
    explore_q_slots(items, slots, consumers)


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("items", [1, 2, 5])
def test_claimed_items_reach_every_consumer_with_their_q_and_the_end_after_them(items, slots,
                                                                               consumers):
    # (a program claims at least its first item: none with zero)
    explore_q_slots(items, slots, consumers, claims=True)


def test_the_q_slot_model_catches_what_the_protocol_guards_against():
    # the loader's first wait on a fresh free barrier at parity 0 waits for a phase that
    # only the consumers of an item not yet loaded could complete
    with pytest.raises(AssertionError, match="deadlock"):
        explore_q_slots(2, 2, 2, free_parity_flip=False)
    # a consumer releasing its slot before it stores O through it
    with pytest.raises(AssertionError, match="after its release|overwrites"):
        explore_q_slots(3, 2, 2, release_before_store=True)
    # the end written into its slot before the consumers freed it: an index unread is
    # overwritten, or the ready barrier's extra phase leaves a consumer waiting for good
    with pytest.raises(AssertionError, match="read index|deadlock"):
        explore_q_slots(2, 1, 2, claims=True, end_without_wait=True)
    # a slot given back late with one slot: the next item waits on the slot still held
    with pytest.raises(AssertionError, match="deadlock"):
        explore_q_slots(2, 1, 2, late_free=True)


@pytest.mark.parametrize("claims", [False, True])
@pytest.mark.parametrize("consumers", [2, 3])
@pytest.mark.parametrize("items", [1, 2, 5])
def test_q_slots_given_back_under_the_next_item_never_hang_or_load_over_a_store(
        items, consumers, claims):
    # `hopper.forward.LATE_Q_FREE` (two Q slots): each slot goes back
    # once the consumer has read its next item's Q, or when it leaves
    explore_q_slots(items, 2, consumers, claims=claims, late_free=True)


def explore_bwd_slots(steps: int, stages: int, bufs: int, slot_by_dq: bool = True,
                      load_before_dq: bool = False) -> None:
    """The Hopper backward's ring of Q/dO slots and dQ's buffers (`backward_kernel._steps`
    and `_dq_writer`, where a slot is released at its step's end: not EARLY_FREE, dQ in one
    part), on mbarriers' parity waits, over every interleaving. The compute warps (one
    party) wait on step t's slot's ready barrier, read the slot through the step, wait on
    dQ buffer t % bufs's free barrier, write dQ there and arrive on its ready barrier, and
    (not `slot_by_dq`) on the slot's free barrier. The writer loads steps 0 .. stages - 1,
    then for each step t waits for its dQ, loads step t + stages into t's slot (not
    `slot_by_dq`: after waiting on the slot's free barrier; `slot_by_dq`
    (`hopper.backward.SLOT_BY_DQ`): the dQ it waited for stands for it), reads the dQ and
    gives its buffer back. Raises AssertionError on a deadlock, a load over a slot the
    compute warps still read, a step reading another step's Q, or the writer reading a dQ
    not its step's. `load_before_dq`: the writer loads before it waits for the dQ (a bug
    under `slot_by_dq`)."""
    def passes(completed: int, parity: int) -> bool:
        return (completed & 1) != parity

    def bump(phases: tuple, i: int) -> tuple:
        return phases[:i] + (phases[i] + 1,) + phases[i + 1:]

    @functools.cache
    def step(comp: tuple, writer: tuple, slot: tuple, landing: tuple, ready: tuple,
             free: tuple, dq: tuple, dq_ready: tuple, dq_free: tuple) -> None:
        moves = 0
        t, stage = comp
        w, wstage = writer

        def load(item, slot, landing):  # the writer issues item's load into its slot
            s = item % stages
            using = t < steps and t % stages == s and stage in ("read", "buf")
            assert not using, f"step {item}'s load overwrites slot {s} while step {t} reads it"
            assert landing[s] is None
            return landing[:s] + (item,) + landing[s + 1:]

        for s in range(stages):  # a load lands
            if landing[s] is not None:
                moves += 1
                step(comp, writer, slot[:s] + (landing[s],) + slot[s + 1:],
                     landing[:s] + (None,) + landing[s + 1:], bump(ready, s), free, dq,
                     dq_ready, dq_free)
        # the compute warps
        if t < steps:
            s, b = t % stages, t % bufs
            if stage == "wait" and passes(ready[s], (t // stages) & 1):
                assert slot[s] == t, f"step {t} reads slot {s}, which holds step {slot[s]}"
                moves += 1
                step((t, "read"), writer, slot, landing, ready, free, dq, dq_ready, dq_free)
            elif stage == "read":
                moves += 1
                step((t, "buf"), writer, slot, landing, ready, free, dq, dq_ready, dq_free)
            elif stage == "buf" and passes(dq_free[b], ((t // bufs) & 1) ^ 1):
                moves += 1
                step((t + 1, "wait"), writer, slot, landing, ready,
                     free if slot_by_dq else bump(free, s), dq[:b] + (t,) + dq[b + 1:],
                     bump(dq_ready, b), dq_free)
        # the writer: the first loads, then each step's dQ
        if w < 0:  # (the first loads: -n .. -1 load steps 0 .. n - 1)
            item = w + min(stages, steps)
            if (slot_by_dq or passes(free[item % stages], 1)) and landing[item % stages] is None:
                moves += 1
                step(comp, (w + 1, "dq" if w + 1 == 0 else "pro"), slot,
                     load(item, slot, landing), ready, free, dq, dq_ready, dq_free)
        elif w < steps:
            b, nxt = w % bufs, w + stages
            s = nxt % stages
            ok_slot = slot_by_dq or passes(free[s], ((nxt // stages) & 1) ^ 1)
            loading = wstage == ("dq" if load_before_dq else "load")
            if loading and (nxt >= steps or (ok_slot and landing[s] is None)):
                # step w + stages's load (none past the last step), then the dQ's wait
                # (load_before_dq) or the add
                moves += 1
                step(comp, (w, "wait" if load_before_dq else "add"), slot,
                     landing if nxt >= steps else load(nxt, slot, landing), ready, free, dq,
                     dq_ready, dq_free)
            elif (wstage in ("dq", "wait") and not loading
                  and passes(dq_ready[b], (w // bufs) & 1)):
                moves += 1
                step(comp, (w, "load" if wstage == "dq" else "add"), slot, landing, ready,
                     free, dq, dq_ready, dq_free)
            elif wstage == "add":
                assert dq[b] == w, f"the writer adds buffer {b} for step {w}: it holds {dq[b]}"
                moves += 1
                step(comp, (w + 1, "dq"), slot, landing, ready, free, dq, dq_ready,
                     bump(dq_free, b))
        if not moves:
            assert t >= steps and w >= steps, f"deadlock: compute {comp}, writer {writer}"

    first = -min(stages, steps)
    step((0, "wait"), (first, "pro" if first < 0 else "dq"), (None,) * stages,
         (None,) * stages, (0,) * stages, (0,) * stages, (None,) * bufs, (0,) * bufs,
         (0,) * bufs)


@pytest.mark.parametrize("slot_by_dq", [False, True])
@pytest.mark.parametrize("stages, bufs", [(2, 1), (2, 2), (3, 2)])
@pytest.mark.parametrize("steps", [0, 1, 2, 5])
def test_the_backward_slots_freed_by_dqs_hand_off_never_hang_or_load_over_a_read(
        steps, stages, bufs, slot_by_dq):
    explore_bwd_slots(steps, stages, bufs, slot_by_dq)


def test_the_backward_slot_model_catches_a_load_before_the_dq():
    # under SLOT_BY_DQ the dQ the writer waits for is all that says the slot is free: a
    # load issued before that wait lands on a slot the compute warps still read
    with pytest.raises(AssertionError, match="overwrites"):
        explore_bwd_slots(3, 2, 2, slot_by_dq=True, load_before_dq=True)
