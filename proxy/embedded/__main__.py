"""``python -m proxima.proxy.embedded --model DIR --port N``: same as ``proxima engine``."""

from proxima.cli import main

raise SystemExit(main(["engine", *__import__("sys").argv[1:]]))
