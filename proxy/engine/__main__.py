"""``python -m proxy.engine --model DIR --port N``: same as ``proxima engine``."""

from proxy.cli import main

raise SystemExit(main(["engine", *__import__("sys").argv[1:]]))
