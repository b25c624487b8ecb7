"""Loaded by ``proxima serve`` when ``bench/gc_cost.py`` puts this folder on its path: times
the garbage collector's passes (``gc.callbacks``, thread CPU) and writes the totals to
``$GC_PROBE_DIR/gc_<pid>.json`` every half second. ``GC_THRESH`` (``a,b,c``) replaces the
thresholds the proxy sets once start-up is frozen; a file ``reset_<pid>`` in that folder
restarts the longest-pause figures (the bench's window begins); a file ``count_<pid>`` adds
the oldest generation's size to the next report (a walk of every object in it, so only when
asked: at the window's end, not twice a second in the process being measured)."""

import os

if os.environ.get("GC_PROBE_DIR"):
    import gc
    import json
    import threading
    import time

    _out = os.environ["GC_PROBE_DIR"]
    _pid = os.getpid()
    _state = {"cpu": [0.0] * 3, "passes": [0] * 3, "longest": [0.0] * 3, "begun": 0.0}

    def _timed(phase: str, info: dict) -> None:
        if phase == "start":
            _state["begun"] = time.thread_time()
            return
        g, spent = info["generation"], time.thread_time() - _state["begun"]
        _state["cpu"][g] += spent
        _state["passes"][g] += 1
        _state["longest"][g] = max(_state["longest"][g], spent)

    def _report() -> None:
        wanted = os.environ.get("GC_THRESH")
        while True:
            time.sleep(0.5)
            if wanted and gc.get_freeze_count() > 0:  # the proxy has set its own by then
                gc.set_threshold(*map(int, wanted.split(",")))
                wanted = None
            reset = os.path.join(_out, f"reset_{_pid}")
            if os.path.exists(reset):
                _state["longest"] = [0.0] * 3
                os.remove(reset)
            row = {
                "process_cpu": sum(os.times()[:2]),
                "gc_cpu": _state["cpu"],
                "passes": _state["passes"],
                "longest": _state["longest"],
                "thresholds": gc.get_threshold(),
            }
            count = os.path.join(_out, f"count_{_pid}")
            if os.path.exists(count):
                row["oldest_objects"] = len(gc.get_objects(2))
                os.remove(count)
            tmp = os.path.join(_out, f"gc_{_pid}.tmp")
            with open(tmp, "w") as f:
                json.dump(row, f)
            os.replace(tmp, os.path.join(_out, f"gc_{_pid}.json"))

    gc.callbacks.append(_timed)
    threading.Thread(target=_report, daemon=True).start()
