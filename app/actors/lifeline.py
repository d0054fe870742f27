"""Tie a child process's life to its parent's, from inside the child.

``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the parent
process; so parents fork only from their main thread (never from trio's worker threads,
which trio retires after idling), and the child sets the signal itself first thing, then
checks that its parent did not already die before the signal was armed.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits.

    Raises SystemExit at once if the parent is already gone (we were re-parented).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != expected_parent:
        raise SystemExit(f"parent {expected_parent} died before this process started")
