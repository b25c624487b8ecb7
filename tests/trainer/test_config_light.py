"""The trainer's config imports no store: ``proxima production ...`` and ``proxima trainer
--help`` start in a fraction of a second (an operator's promotion lands while streams run)."""

from __future__ import annotations

import subprocess
import sys


def test_the_trainer_config_and_the_cli_import_no_store_or_tracker() -> None:
    code = (
        "import sys, proxima.cli, proxima.trainer.config, proxima.trainer.cli\n"
        "heavy = [m for m in sys.modules if m.startswith(('proxima.proxy.store', 'mlflow',"
        " 'wandb', 'tensorboard', 'sqlalchemy'))]\n"
        "print(heavy)\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
