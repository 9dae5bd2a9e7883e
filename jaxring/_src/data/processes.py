"""``ProcessPool``: worker processes that are fresh interpreters, fed through pipes.

Why not ``multiprocessing`` (or ``concurrent.futures.ProcessPoolExecutor`` on it): forking a
process that runs JAX's threads can deadlock the child, and the other start methods
(``forkserver``, ``spawn``) run the user's ``__main__`` script again in every worker, so a training
script without an ``if __name__ == "__main__":`` guard would start its own training in each of
them (and the README's example would fail). These workers are ``python -c`` interpreters that
import only the data modules: ``jaxring`` and ``jaxring._src`` are entered as bare package
objects, so a worker imports NumPy, Pillow, simplejpeg and OpenCV but not JAX (0.2 s to start,
not 1 s, and no JAX state in each worker). Tasks are ``(function, args)`` pickled by reference;
a feeder thread per worker sends one task at a time and completes its future, so a slow task
never holds back the others and ``Future.cancel`` works until a task is sent.
"""
from __future__ import annotations

import concurrent.futures
import os
import queue
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Callable

_DATA_DIR = os.path.dirname(os.path.abspath(__file__))
_PACKAGES = (("jaxring", os.path.dirname(os.path.dirname(_DATA_DIR))),
             ("jaxring._src", os.path.dirname(_DATA_DIR)),
             ("jaxring._src.data", _DATA_DIR))
_BOOT = """import sys, types
for name, path in {packages!r}:
  module = types.ModuleType(name)
  module.__path__ = [path]
  sys.modules[name] = module
from jaxring._src.data.processes import serve
serve(int(sys.argv[1]), int(sys.argv[2]))
"""
# One thread inside each library: the workers are the parallelism.
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "OPENCV_FOR_THREADS_NUM": "1"}


def serve(task_fd: int, result_fd: int) -> None:
  """A worker's loop: run the initializer, then each task, until the pipe closes."""
  # Ctrl-C reaches the whole process group: the parent handles it and closes the pipes, which
  # ends this loop; a worker that raised KeyboardInterrupt itself would only print a traceback
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  tasks, results = Connection(task_fd, writable=False), Connection(result_fd, readable=False)
  try:
    initializer, args = tasks.recv()
    initializer(*args)
  except BaseException as e:  # noqa: BLE001 (reported to the parent, which fails the futures)
    results.send((False, RuntimeError(f"data worker initialization failed: {e!r}")))
    return
  results.send((True, None))
  while True:
    try:
      message = tasks.recv()
    except (EOFError, OSError):
      return  # the parent closed the pipe or died
    if message is None:
      return
    fn, args = message
    try:
      reply = (True, fn(*args))
    except BaseException as e:  # noqa: BLE001
      reply = (False, e)
    try:
      results.send(reply)
    except OSError:
      return  # the parent is gone
    except Exception:  # an exception that does not pickle
      results.send((False, RuntimeError(repr(reply[1]))))


class ProcessPool:
  """``num_workers`` worker processes; :meth:`submit` returns a ``concurrent.futures.Future``.

  Example:
    >>> pool = ProcessPool(2, initializer=some_module.init, initargs=(spec,))
    >>> pool.submit(some_module.task, 1, 2).result()
    >>> pool.shutdown()
  """

  def __init__(self, num_workers: int, initializer: Callable, initargs: tuple = ()):
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._closed = False
    self.processes: list[subprocess.Popen] = []
    self._threads: list[threading.Thread] = []
    self._ready: list[threading.Event] = []
    env = dict(os.environ)
    for key, value in _WORKER_ENV.items():
      env.setdefault(key, value)
    boot = _BOOT.format(packages=_PACKAGES)
    for i in range(num_workers):
      task_r, task_w = os.pipe()
      result_r, result_w = os.pipe()
      process = subprocess.Popen([sys.executable, "-c", boot, str(task_r), str(result_w)],
                                 pass_fds=(task_r, result_w), env=env, stdin=subprocess.DEVNULL)
      os.close(task_r)
      os.close(result_w)
      tasks, results = Connection(task_w, readable=False), Connection(result_r, writable=False)
      tasks.send((initializer, initargs))
      ready = threading.Event()
      thread = threading.Thread(target=self._feed, args=(process, tasks, results, ready),
                                daemon=True, name=f"jaxring-data-feeder-{i}")
      thread.start()
      self.processes.append(process)
      self._threads.append(thread)
      self._ready.append(ready)

  def wait_ready(self, timeout: float | None = None) -> None:
    """Returns once every worker has run its initializer (or failed to)."""
    for ready in self._ready:
      ready.wait(timeout)

  def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
    if self._closed:
      raise RuntimeError("ProcessPool: submit after shutdown")
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._queue.put((future, fn, args))
    return future

  def _feed(self, process: subprocess.Popen, tasks: Connection, results: Connection,
            ready: threading.Event) -> None:
    error = None
    try:
      ok, value = results.recv()  # the initializer's outcome
      if not ok:
        error = value
    except (EOFError, OSError):
      error = RuntimeError(f"a data worker process (pid {process.pid}) exited at start-up "
                           f"(exit code {process.wait()})")
    ready.set()
    while True:
      item = self._queue.get()
      if item is None:
        break
      future, fn, args = item
      if not future.set_running_or_notify_cancel():
        continue
      if error is not None:
        future.set_exception(error)
        continue
      try:
        tasks.send((fn, args))
        ok, value = results.recv()
      except (EOFError, OSError):
        error = RuntimeError(f"a data worker process (pid {process.pid}) died (exit code "
                             f"{process.wait()}) while decoding")
        future.set_exception(error)
        continue
      if ok:
        future.set_result(value)
      else:
        future.set_exception(value)
    try:
      tasks.send(None)
    except OSError:
      pass
    tasks.close()
    results.close()

  def shutdown(self, timeout: float = 10.0) -> None:
    """Cancels the tasks not yet sent, lets the running ones finish, stops the processes."""
    if self._closed:
      return
    self._closed = True
    while True:
      try:
        item = self._queue.get_nowait()
      except queue.Empty:
        break
      if item is not None:
        item[0].cancel()
    for _ in self._threads:
      self._queue.put(None)
    for thread in self._threads:
      thread.join(timeout)
    for process in self.processes:
      try:
        process.wait(timeout)
      except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
