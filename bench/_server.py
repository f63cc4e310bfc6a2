"""Start `python -m serve.rollout` on loopback for a benchmark, and stop it whatever happens."""

import contextlib
import os
import subprocess
import sys
import time
import urllib.request


@contextlib.contextmanager
def running_server(server_args: list[str], port: int, memory_fraction: str = "0.45"):
    """Yields the server's URL once /health answers 200 (its warm-up done: a 503 "starting" is an HTTPError,
    an OSError, so the loop waits on); terminates the server on exit. The server gets
    `memory_fraction` of the GPU so the benchmark process can score on the same device."""
    env = os.environ | {"XLA_PYTHON_CLIENT_MEM_FRACTION": memory_fraction}
    proc = subprocess.Popen([sys.executable, "-m", "serve.rollout", *server_args, "--port", str(port)], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"server failed to start (exit {proc.returncode})") from None
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
