"""Ctrl-C of the command line: one line, an exit within seconds at any moment, a folder that resumes.

Python runs its SIGINT handler in the main thread between bytecodes, so a main thread that
waits inside XLA (a compiled chunk, a compile, orbax's writes) would not see Ctrl-C until the
wait ends, and an interpreter that shuts down with orbax's threads alive prints their
tracebacks or waits for them. So the command line blocks SIGINT in its threads, and one
thread of its own hears it through Python's signal wake-up pipe, whichever thread the
signal reached (one started by an import before the block still takes it): it raises
``KeyboardInterrupt`` in the main thread (which unwinds, releasing the job's lock), and ends
the process after a grace period, or at a second Ctrl-C, whatever the main thread is doing.
What the job leaves is what a kill leaves: every save is atomic, so ``--resume`` continues
exactly from the last checkpoint.
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
    self._write = -1
    self._again = False  # the interruption is to be raised again in the main thread
    self._echoes = 0  # the calls of interrupt_main: each writes a SIGINT to the wake-up pipe too
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
    self._write = write
    # Python's C-level handler, in whichever thread takes the signal, writes its number here.
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    signal.signal(signal.SIGINT, self._handle)
    self._unraisable, sys.unraisablehook = sys.unraisablehook, self._ignored
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    threading.Thread(target=self._wait, args=(read,), name="gossipjax-interrupt", daemon=True).start()
    return True

  def _handle(self, signum, frame) -> None:
    # Run by Python in the main thread, for the signal and for the waiting thread's interrupt_main:
    # the interruption, once, after the waiting thread has marked it.
    if not self.fired or self._raised:
      return
    if _inside_the_hook(frame):  # what the hook raised would be printed: raise it after
      self._again_after()
      return
    self._raised = True
    raise KeyboardInterrupt

  def _ignored(self, unraisable) -> None:
    # The interruption raised where Python ignores exceptions (a garbage-collection callback, a
    # __del__): not printed, and raised again once this hook has returned (the waiting thread
    # does it, woken by a byte that is no signal's).
    if self.fired and isinstance(unraisable.exc_value, KeyboardInterrupt):
      self._raised = False
      self._again_after()
      return
    self._unraisable(unraisable)

  def _again_after(self) -> None:
    self._again = True
    os.write(self._write, b"\0")

  def _wait(self, read: int) -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a thread that takes it, in any process
    self._next(read, None)
    self.fired = True
    self._interrupt_main()  # the main thread unwinds at its next bytecode, through its finally blocks
    self._next(read, self._grace)  # a second Ctrl-C ends it at once
    self.exit()

  def _out_of_the_hook(self) -> None:
    # Waits, at most the grace period, until the main thread has left the hook: interrupted inside it
    # again, it would ask again, and the hook would never return.
    main, end = threading.main_thread().ident or 0, time.monotonic() + self._grace
    while _inside_the_hook(sys._current_frames().get(main)) and time.monotonic() < end:
      time.sleep(0.002)

  def _interrupt_main(self) -> None:
    # Through Python's handler, which writes to the pipe too: a byte that is not a Ctrl-C.
    self._echoes += 1
    _thread.interrupt_main()

  def _next(self, read: int, timeout: float | None) -> None:
    """Waits for the next SIGINT on the wake-up pipe that is a Ctrl-C, at most ``timeout`` seconds."""
    end = None if timeout is None else time.monotonic() + timeout
    while True:
      left = None if end is None else max(end - time.monotonic(), 0.0)
      if not select.select([read], [], [], left)[0]:
        return
      got = os.read(read, 64)
      if self._again:
        self._again = False
        self._out_of_the_hook()
        self._interrupt_main()
      heard = got.count(int(signal.SIGINT))
      taken = min(heard, self._echoes)
      self._echoes -= taken
      if heard > taken:
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


_IGNORED = Interruption._ignored.__code__


def _inside_the_hook(frame) -> bool:
  """Whether ``frame`` runs inside `Interruption._ignored` (in it, or in what it calls)."""
  while frame is not None:
    if frame.f_code is _IGNORED:
      return True
    frame = frame.f_back
  return False
