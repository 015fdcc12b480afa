"""The simulation's event kinds, in the order they run at one instant: work finishing frees room
before new work lands (a hand-off's start, known in advance, comes last; then the prefix index's
lease heartbeats, which change no choice; a prefix pull's end last: a run ending at that instant
already admits the request the pull held)."""

WORKER, HANDOFF_DONE, ADOPT, ENQUEUE, RESTART, FAULT, ARRIVE, HANDOFF_START, HEARTBEAT, PULL_DONE = range(10)
