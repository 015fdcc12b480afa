"""The simulation's event kinds, in the order they run at one instant: work finishing frees room
before new work lands (a hand-off's start, known in advance, comes last; then the prefix index's
lease heartbeats, which change no choice)."""

WORKER, HANDOFF_DONE, ADOPT, ENQUEUE, RESTART, FAULT, ARRIVE, HANDOFF_START, HEARTBEAT = range(9)
