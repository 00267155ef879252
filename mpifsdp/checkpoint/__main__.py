"""`python -m mpifsdp.checkpoint ...` was once a command of its own (it exited 0 having checked
nothing); the commands are `python -m mpifsdp inspect|export ...`. Say so, and fail: a script that
still calls the old name must not take silence for a checked checkpoint."""

import sys

command = " ".join(sys.argv[1:]) or "inspect DIR"
sys.exit(f"python -m mpifsdp.checkpoint is not a command: run python -m mpifsdp {command}")
