"""Run from a fork server by ``test_fork_server.py``: says what it was given.

    python -m fork_probe CODE [--wait]

prints one JSON line (its arguments, ``AFD_FORK_PROBE``, its working
directory, whether it leads its own session, the name ``__main__`` goes by,
its command line as ``ps`` shows it),
then exits with CODE, or first waits to be killed with ``--wait``.
"""

import json
import os
import sys
import time
from pathlib import Path

main = sys.modules["__main__"]
seen = {
    "argv": sys.argv[1:],
    "env": os.environ.get("AFD_FORK_PROBE"),
    "cwd": os.getcwd(),
    "session_leader": os.getsid(0) == os.getpid(),
    "main": main.__spec__.name if main.__spec__ else None,
    "ps": Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(),
}
print(json.dumps(seen), flush=True)
if "--wait" in sys.argv:
    time.sleep(600)
sys.exit(int(sys.argv[1]))
