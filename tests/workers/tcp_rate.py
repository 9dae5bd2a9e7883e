"""Worker for tests/test_cluster.py: measures one TCP transfer between two namespaces.

  recv PORT NBYTES        listen on PORT, receive NBYTES, print "received N bytes in S s"
  send ADDR PORT NBYTES   connect to ADDR:PORT and send NBYTES
The receiver times from the first byte to the last, so connection set-up is not counted.
"""
import socket
import sys
import time


def recv(port: int, nbytes: int) -> None:
  with socket.create_server(("0.0.0.0", port)) as srv:
    srv.settimeout(30)
    print("listening", flush=True)
    conn, _ = srv.accept()
    with conn:
      conn.settimeout(30)
      got, first = 0, None
      while got < nbytes:
        chunk = conn.recv(1 << 20)
        if not chunk:
          break
        first = first or time.perf_counter()
        got += len(chunk)
      seconds = time.perf_counter() - first
  print(f"received {got} bytes in {seconds:.4f} s", flush=True)


def send(addr: str, port: int, nbytes: int) -> None:
  payload = b"\0" * (1 << 20)
  deadline = time.monotonic() + 20
  while True:
    try:
      conn = socket.create_connection((addr, port), timeout=30)
      break
    except ConnectionRefusedError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.05)
  with conn:
    sent = 0
    while sent < nbytes:
      conn.sendall(payload[:min(len(payload), nbytes - sent)])
      sent += min(len(payload), nbytes - sent)


if __name__ == "__main__":
  if sys.argv[1] == "recv":
    recv(int(sys.argv[2]), int(sys.argv[3]))
  else:
    send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
