"""A stand-in for a server under the harness: answers GET /health on the port it is
given, says so on stdout, and behaves on SIGTERM as its mode says.

    python stand_in_server.py PORT MODE

MODE: `clean` exits 0 on SIGTERM; `fails` exits 1 on it; `ignores` ignores it;
`leaves-child` starts a child that sleeps on, then exits 0 on it; `dies` exits 3 at once.
"""

from __future__ import annotations

import http.server
import signal
import subprocess
import sys
import threading

SLEEPER = "import time; time.sleep(600)  # the stand-in's child"


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def main(port: int, mode: str) -> None:
    if mode == "dies":
        print("the stand-in gives up", flush=True)
        sys.exit(3)
    exit_code = {"clean": 0, "fails": 1, "leaves-child": 0}.get(mode)
    if exit_code is None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(exit_code))
    if mode == "leaves-child":
        subprocess.Popen([sys.executable, "-c", SLEEPER])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"serving on {port}", flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
