"""A tensor-parallel worker starts however long its ranks take to come up: the group's rendezvous waits only the
collective timeout (meant for a step's collectives, and maybe short), so rank 0 first waits, within the start-up
timeout, for every rank to say it is joining. Here a rank's interpreter alone (importing torch) takes longer than a
0.5 s collective timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from stack import REPO


def test_ranks_slower_to_start_than_the_collective_timeout_still_join():
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "pdserve", "generate", "--tp", "2", "--dtype", "float32",
                           "--input-ids", "5,6,7", "--max-new-tokens", "3", "--collective-timeout", "0.5", "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads(proc.stdout)["output_ids"]) == 3
