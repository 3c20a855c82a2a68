"""A stand-in gang worker for preemption tests, run as a real process by a kubelet (the simulator's,
or the node agent on a real control plane).

It works for RUN_S seconds (RESUME_S when it resumed from its checkpoint), then finishes; on SIGTERM
it commits its "checkpoint" and exits 75; rank FAIL_RANK fails at once (exit 3, a bug in the
training code). It marks ``<gang>-<rank>.ready`` when at work and ``.resumed`` when it resumed, in
WORK_DIR.
"""

WORKER = """
import os, pathlib, signal, sys, time
here, gang, rank = pathlib.Path(os.environ["WORK_DIR"]), os.environ["HYBRIDFLOW_GANG"], os.environ["RANK"]
ckpt = here / f"{gang}-{rank}.ckpt"
resumed = ckpt.exists()
if resumed:
    (here / f"{gang}-{rank}.resumed").write_text(ckpt.read_text())
def stop(*_):
    ckpt.write_text("7")
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
(here / f"{gang}-{rank}.ready").touch()
if rank == os.environ.get("FAIL_RANK"):
    sys.exit(3)  # a bug in the training code
deadline = time.monotonic() + float(os.environ["RESUME_S" if resumed else "RUN_S"])
while time.monotonic() < deadline:
    time.sleep(0.02)
"""
