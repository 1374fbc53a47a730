"""Ctrl-C of the command line: one line, an exit within seconds at any moment, a folder that resumes.

Python runs its SIGINT handler in the main thread between bytecodes, so a main thread that
waits inside XLA (a compiled chunk, a compile, orbax's writes) would not see Ctrl-C until the
wait ends, and an interpreter that shuts down with orbax's threads alive prints their
tracebacks or waits for them. So the command line blocks SIGINT in its threads, and one
thread of its own hears it through Python's signal wake-up pipe, whichever thread the
signal reached (one started by an import before the block still takes it): it raises
``KeyboardInterrupt`` in the main thread (which unwinds, releasing the job's lock), and ends
the process after a grace period, or at a second Ctrl-C, whatever the main thread is doing. What the job leaves is what a kill leaves:
every save is atomic, so ``--resume`` continues exactly from the last checkpoint.
"""

from __future__ import annotations

import _thread
import os
import select
import signal
import sys
import threading
import time
from typing import Callable

#: The exit status of a process ended by Ctrl-C (128 + SIGINT, as a shell reports it).
STATUS = 128 + int(signal.SIGINT)


class Interruption:
  """Ctrl-C for a command-line process: `install` once in the main thread, before the job's threads start.

  Args:
    message: called once to give the line to print (what was interrupted, and how to continue).
    grace: seconds the main thread has to unwind before the process ends.
  """

  def __init__(self, message: Callable[[], str], grace: float = 3.0):
    self._message, self._grace = message, grace
    self._said = threading.Lock()
    self._raised = False
    self.fired = False  # set once Ctrl-C came: whatever the main thread raises after it is the interruption

  def install(self) -> bool:
    """Blocks SIGINT in this thread and the threads it starts from now on, and starts the thread that hears it.

    Returns whether it did (not on a platform without ``pthread_sigmask``, nor outside the
    main thread).
    """
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
      return False
    read, write = os.pipe()
    os.set_blocking(write, False)
    # Python's C-level handler, in whichever thread takes the signal, writes its number here.
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    signal.signal(signal.SIGINT, self._handle)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    threading.Thread(target=self._wait, args=(read,), name="gossipjax-interrupt", daemon=True).start()
    return True

  def _handle(self, signum, frame) -> None:
    # Run by Python in the main thread, for the signal and for the waiting thread's interrupt_main:
    # the interruption, once, after the waiting thread has marked it.
    if self.fired and not self._raised:
      self._raised = True
      raise KeyboardInterrupt

  def _wait(self, read: int) -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a thread that takes it, in any process
    self._next(read, None)
    self.fired = True
    # The main thread unwinds at its next bytecode, through its finally blocks. This goes through
    # Python's handler, which writes to the pipe too: a byte that is not a second Ctrl-C.
    _thread.interrupt_main()
    self._next(read, self._grace, skip=1)  # a second Ctrl-C ends it at once
    self.exit()

  @staticmethod
  def _next(read: int, timeout: float | None, skip: int = 0) -> None:
    """Waits for the SIGINT after the next ``skip`` on the wake-up pipe, at most ``timeout`` seconds."""
    end = None if timeout is None else time.monotonic() + timeout
    while True:
      left = None if end is None else max(end - time.monotonic(), 0.0)
      if not select.select([read], [], [], left)[0]:
        return
      skip -= os.read(read, 64).count(int(signal.SIGINT))
      if skip < 0:
        return

  def exit(self) -> None:
    """Prints the line (once, whichever thread gets here first) and ends the process at once, threads and all."""
    if self._said.acquire(blocking=False):
      try:
        line = self._message()
      except Exception:  # the line must not fail the exit
        line = "interrupted"
      sys.stdout.flush()
      sys.stderr.write(line + "\n")
      sys.stderr.flush()
      os._exit(STATUS)
    threading.Event().wait()  # the other thread is printing and exiting
